"""The torch port of SGLang's murmur_hash32 (seeded sampling on CPU) against a byte-wise
MurmurHash3_x86_32 written from the reference algorithm (smhasher), over the 16 bytes SGLang's
Triton kernel hashes: seed low/high 32 bits, position, column, little-endian. (Also checked
against the `mmh3` package when this was written.)"""
import struct

import torch

from megatron_fp8rl.compat.sglang_cpu_sampling import murmur_hash32


def _murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    c1, c2, mask = 0xCC9E2D51, 0x1B873593, 0xFFFFFFFF
    h = seed
    for (k,) in struct.iter_unpack("<I", data[: len(data) // 4 * 4]):
        k = (k * c1) & mask
        k = ((k << 15) | (k >> 17)) & mask
        k = (k * c2) & mask
        h ^= k
        h = ((h << 13) | (h >> 19)) & mask
        h = (h * 5 + 0xE6546B64) & mask
    assert len(data) % 4 == 0  # SGLang hashes whole 4-byte blocks only
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & mask
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & mask
    return h ^ (h >> 16)


def test_murmur_hash32_matches_the_reference_algorithm():
    seeds = torch.tensor([0, 1, 42, 2**40 + 7, 2**62 - 1])
    positions = torch.tensor([0, 5, 17, 300, 2**31 - 1])
    columns = torch.arange(0, 50000, 997)
    hashed = murmur_hash32(seeds, positions, columns)
    assert hashed.dtype == torch.uint32 and hashed.shape == (5, len(columns))
    for i, (seed, position) in enumerate(zip(seeds.tolist(), positions.tolist())):
        for j, column in enumerate(columns.tolist()):
            data = struct.pack("<IIII", seed & 0xFFFFFFFF, seed >> 32, position, column)
            assert int(hashed[i, j]) == _murmur3_x86_32(data), (seed, position, column)
