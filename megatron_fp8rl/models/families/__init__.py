"""One file per model family; models/registry.py imports every module here.

Owns nothing itself. Each module defines `FAMILY = ModelFamily(...)` (models/family.py): adding a
family is adding its file here. Family files are pure data (the SGLang plugin loads them in
SGLang's processes). Must not import: anything but the standard library and models.family,
models.families.
"""
