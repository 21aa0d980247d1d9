"""Shared helpers of the ahead-of-time compile tests (tests/test_triton_compile.py, tests/test_gluon_*_compile.py).

A Triton kernel (ASTSource) or a Gluon kernel (GluonASTSource, triton.experimental.gluon._runtime) compiles
without a GPU through triton.compile for GPUTarget("cuda", 90, 32); the signature names each argument's type
(a tensor descriptor's: mangle_type of a host-side Gluon TensorDescriptor built on CPU tensors, or
tensordesc<bf16[block]>). What a GPU would run is then read from the PTX, from ptxas -v and from the SASS
(cuobjdump), both tools bundled with Triton. The test modules import-or-skip Triton before importing this.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon._runtime import GluonASTSource

from megamoe.backends.triton.kernels.gluon_common import SMEM_PER_CTA

TRITON = tuple(int(n) for n in re.findall(r"\d+", triton.__version__)[:2])  # (major, minor): some budgets differ by release
# Spills that one Triton release's code generation adds to a kernel the tests otherwise hold to none (or to a smaller
# bound), as compiled here under each release CI uses, keyed by the kernel's name in its test. On an H200 the layer
# ran under 3.7.1 and 3.8.0 at Triton 3.6.0's speed (README, "Two commands"). Values: assert_no_spills_or_serialisation's
# bounds (spill bytes each way, stack-frame bytes, local-memory instructions in the SASS).
KNOWN_SPILLS = {
    (3, 7): {"s4b1-gu fp16": dict(spills=4, stack=8, local=2), "ep_bwd sm100": dict(spills=308)},
    (3, 8): {"tma down_dgrad": dict(spills=4), "down_dgrad router-h_w": dict(spills=192, stack=128, local=96),
             "gate_up_fwd_pull_handoff": dict(spills=16, stack=16, local=8),
             # the weight-grad kernel's gathering producer (a warpgroup at 40 registers) since it claims tiles
             "dw coop-gather": dict(spills=24, stack=16, local=10),
             "dw fp16 gathering": dict(spills=24, stack=16, local=10)},
    # gate_up_fwd's Gluon kernel on TMA-copied x rows without the hand-off (a benchmarks' tile: the table runs the
    # hand-off kernel or the gathering one), consumers at 232 registers, since each also walks the expert-grouped
    # tile order (two more pointers live across its loop)
    (3, 9): {"s3b2-gu-tma": dict(local=8), "s4b1-gu-tma": dict(spills=8, stack=8, local=10)},
}.get(TRITON, {})
SMEM_LIMIT = SMEM_PER_CTA  # bytes of shared memory one CTA may use on sm_90


def tensordesc(block: list[int]) -> str:
    """The signature type of a bf16 tensor-descriptor argument with this block shape."""
    return f"tensordesc<bf16[{','.join(map(str, block))}]>"


def kernel_signature(fn, constexprs: dict, descriptors: dict, other_type) -> dict:
    """Argument name -> type: "constexpr" for the constexprs, descriptors[name] for a tensor-descriptor
    argument, other_type(name) for every other one."""
    return {name: "constexpr" if name in constexprs else descriptors[name] if name in descriptors else other_type(name)
            for name in fn.arg_names}


def divisible_by_16(fn, names) -> dict:
    """Compile attributes marking the arguments `names` divisible by 16, as the launcher's specialisation sees
    16-byte aligned torch allocations (and sizes that are multiples of 16)."""
    return {(i, ): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in names}


def compile_triton(fn, signature: dict, constexprs: dict, attrs: dict, num_warps: int, num_stages: int, arch: int = 90):
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def compile_gluon(fn, signature: dict, constexprs: dict, attrs: dict):
    """A Gluon kernel for sm_90a; num_warps is its default partition's (gl.warp_specialize adds the workers')."""
    src = GluonASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def ptxas_report(ptx: str, arch: int = 90) -> dict:
    """Registers, spill bytes and stack frame of a kernel, from ptxas -v on its PTX for sm_{arch}a (and the log)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        proc = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", path, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, check=True)
    log = proc.stdout + proc.stderr

    def number(pattern):
        return int(re.search(pattern, log).group(1))

    return dict(registers=number(r"Used (\d+) registers"), spill_stores=number(r"(\d+) bytes spill stores"),
                spill_loads=number(r"(\d+) bytes spill loads"), stack=number(r"(\d+) bytes stack frame"), log=log)


def sass(cubin: bytes) -> str:
    """The kernel's SASS (cuobjdump -sass)."""
    tool = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout


# A TMA load into shared memory in the PTX (Triton 3.6 names the destination shared::cluster, 3.8 and later
# shared::cta).
TMA_LOAD = r"cp\.async\.bulk\.tensor\.{dims}d\.shared::(?:cluster|cta)\.global\.mbarrier::complete_tx::bytes"


def count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


def warp_specialized_report(compiled) -> dict:
    """What every warp-specialized Gluon kernel's checks look at: the PTX and SASS, the ptxas report, and the
    counts of the instructions of its wgmma pipeline, TMA loads, mbarriers, register split and local memory."""
    ptx = compiled.asm["ptx"]
    code = sass(compiled.asm["cubin"])
    return dict(
        compiled=compiled, ptx=ptx, sass=code, ptxas=ptxas_report(ptx),
        wgmma_any=count(r"wgmma\.mma_async", ptx),
        wait_groups=sorted(set(int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx))),
        tma_load_2d=count(TMA_LOAD.format(dims=2), ptx),
        tma_load_3d=count(TMA_LOAD.format(dims=3), ptx),
        cp_async=count(r"cp\.async\.(ca|cg)\.shared\.global", ptx),
        mbar_init=count(r"mbarrier\.init\.shared", ptx),
        mbar_wait=count(r"mbarrier\.try_wait\.parity", ptx),
        mbar_expect=count(r"mbarrier\.arrive\.expect_tx", ptx),
        mbar_arrive=count(r"mbarrier\.arrive\.shared::cta\.b64", ptx),
        setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))),
        local=count(r"\b(STL|LDL)(\.[A-Z0-9]+)*\b", code),
    )


def assert_register_split(name: str, report: dict, producer_regs: int, consumer_regs: int) -> None:
    """setmaxnreg gives the producer and the consumer warpgroups their registers."""
    assert ("dec", str(producer_regs)) in report["setmaxnreg"], f"{name}: producer registers {report['setmaxnreg']}"
    assert ("inc", str(consumer_regs)) in report["setmaxnreg"], f"{name}: consumer registers {report['setmaxnreg']}"


def wgmma_operand_types(ptx: str) -> set:
    """The (a, b) operand types of the kernel's wgmma instructions, e.g. {("bf16", "bf16")}."""
    return set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.(\w+)\.(\w+)", ptx))


def assert_no_spills_or_serialisation(name: str, report: dict, local: int = 0, spills: int = 0, stack: int = 0) -> None:
    """No spills, no stack frame, no local memory in the SASS, no wgmma serialised by ptxas (C7510); where a test
    names a known exception, at most `spills` bytes spilled each way, a `stack`-byte frame and `local` instructions."""
    px = report["ptxas"]
    assert px["spill_stores"] <= spills and px["spill_loads"] <= spills and px["stack"] <= stack, (
        f"{name} spills:\n{px['log']}")
    assert report["local"] <= local, f"{name}: {report['local']} local-memory loads/stores in the SASS"
    assert "C7510" not in px["log"] and "serialized" not in px["log"], f"{name}: wgmma serialised:\n{px['log']}"


def pointers(fn) -> set:
    """The kernel's pointer arguments (named *_ptr)."""
    return {name for name in fn.arg_names if name.endswith("_ptr")}


def int32_arg(name: str) -> str:
    """The type of an argument that is no descriptor: a pointer to int32 (the tile tables), else an int32."""
    return "*i32" if name.endswith("_ptr") else "i32"


# ----------------------------------------------------------------------------------------------------
# Models of the kernels' barrier protocols (the CPU tests that run the kernels' index arithmetic in Python)


class ProtocolError(AssertionError):
    pass


class MBarrier:
    """An mbarrier as the hardware runs it: a phase completes when its pending arrivals and its expected
    transaction bytes both reach zero; wait(parity) passes iff the current phase's parity differs."""

    def __init__(self, name: str, count: int):
        self.name, self.count = name, count
        self.phase = 0  # phases completed so far (the current phase's index)
        self.pending = count
        self.tx = 0

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def arrive(self, tx: int = 0):
        if self.pending == 0:
            raise ProtocolError(f"{self.name}: more arrivals than its count in phase {self.phase}")
        self.pending -= 1
        self.tx += tx
        self._maybe_complete()

    def complete_tx(self, tx: int):
        self.tx -= tx
        if self.tx < 0:
            raise ProtocolError(f"{self.name}: transaction bytes landed in phase {self.phase}, which expected none")
        self._maybe_complete()

    def passes(self, parity: int) -> bool:
        return (self.phase & 1) != parity
