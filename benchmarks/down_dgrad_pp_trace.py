"""EXPERIMENT: per-tile globaltimer stamps of the ping-pong down_dgrad (CTAs 0-7, their first 64 tiles)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    import torch

    import gluon_down_dgrad_bench as B
    from megamoe.backends.triton.kernels import gluon_down_dgrad_split as pp

    out_path, names = sys.argv[1], sys.argv[2:]
    device = torch.device("cuda")
    result = {}
    for spec in names:
        name, _, mode = spec.partition(":")
        pp.NO_EPI = mode == "noepi"
        pp.MODE = {"nomath": 2, "nostore": 3}.get(mode, 0)
        p = B.workload_problem(name, device)
        d, w, gu, rs, be, bl = p["d_rows"], p["w_down"], p["gate_up"], p["row_src"], p["block_expert"], p["blocks"]
        wts = p["weights"]
        fn = lambda: pp.down_dgrad_router_gluon(d, w, gu, rs, wts, be, bl, store_h_w=True)  # noqa: E731
        pp.TIMES = torch.zeros(8 * 64 * 8, dtype=torch.int64, device=device)
        for _ in range(5):
            fn()
        pp.TIMES.zero_()
        fn()
        torch.cuda.synchronize()
        import triton
        times, pp.TIMES = pp.TIMES, None
        ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        pp.TIMES = times
        print(spec, "kernel ms", ms, "TF/s", 2 * d.shape[0] * p["H"] * p["I"] / ms / 1e9, flush=True)
        t = pp.TIMES.view(8, 64, 8).cpu()
        t0 = t[t > 0].min().item()
        rows = []
        for cta in range(2):
            for j in range(24):
                s = [(x - t0) / 1000 if x > 0 else None for x in t[cta, j].tolist()]
                rows.append(dict(cta=cta, j=j, wg=j % 2, t=s))
        med = {}
        for key, (a, b) in {"mainloop": (0, 1), "acc_empty_wait": (1, 2), "acc_write": (2, 3),
                            "acc_ready_to_epi": (3, 4), "piece0": (4, 5), "gu1_wait": (5, 6), "piece1": (6, 7)}.items():
            v = t[:, 2:40, b] - t[:, 2:40, a]
            v = v[(t[:, 2:40, a] > 0) & (t[:, 2:40, b] > 0)].double() / 1000
            med[key] = (v.median().item(), v.min().item(), v.max().item()) if v.numel() else None
        period = (t[:, 3:40, 0] - t[:, 2:39, 0])[t[:, 3:40, 0] > 0]
        med["mma_period"] = (period.double().median().item() / 1000, )
        result[spec] = dict(medians_us=med, trace=rows)
        print(spec, json.dumps(med), flush=True)
        for r in rows[:12]:
            print(r["cta"], r["j"], r["wg"], " ".join(f"{x:8.2f}" if x is not None else "     -  " for x in r["t"][:8]))
        pp.TIMES = None
        del p
        torch.cuda.empty_cache()
    json.dump(result, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
