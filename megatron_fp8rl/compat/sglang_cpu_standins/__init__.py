"""Folder of CPU-tier stand-in packages (`torchvision`, `sgl_kernel`) that
`megatron_fp8rl.compat.sglang_cpu.install()` puts on sys.path. Not imported under this name.
Must not import: anything of ours above layer L1.
"""
