"""Fixtures of the model tests: Transformer Engine's pure-Python recipe code from its wheel
(tests/helpers/te_wheel.py)."""
from tests.helpers.te_wheel import te_recipe_module, te_scaling_functions, te_wheel  # noqa: F401  (fixtures)
