"""Helpers that test modules in more than one folder share, imported explicitly
(`from tests.helpers.processes import run_torchrun`). Fixtures live in the conftest.py of the
folder that uses them; no test module imports a conftest or another test module.

- processes: torchrun runs, the processes they leave, and the permission bits a child meets;
- tiny_hf: tiny random HF checkpoints of each supported architecture (conversion, logits);
- tiny_models: tiny random checkpoints with a tokenizer that SGLang loads (rollout, RL runs);
- megatron_models: an HF folder converted and loaded into Megatron, and its logits;
- rollout: SGLang configs sized for a 2-core CPU box, and the marker for tests that need SGLang;
- train: `megatron-fp8rl train` under torchrun on a tiny run, and its tensorboard scalars;
- png: the check that a written figure is a real PNG.
"""
