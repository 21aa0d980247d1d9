"""The attribute that marks a Hugging Face module patched by megamoe.integrations.hf.patch_model.

Its own module, with no imports, so that megamoe.parallel (loaded by `import megamoe`) can recognise patched
experts modules without importing megamoe.integrations.hf, which imports (and registers with) transformers.

patch_model sets it on each patched experts module (and on DeepSeek-V3's block) to a record with, among
others, `group` (the expert-parallel group or None) and `local_slice` ((first global expert, number of local
experts) when sharded, else None): the two fields megamoe.parallel reads.
"""

PATCH_ATTR = "_megamoe_patch"
