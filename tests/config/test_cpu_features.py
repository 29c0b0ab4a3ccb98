"""cpu_has_native_bf16: /proc/cpuinfo flags, and the ASERVE_CPU_BF16 override."""

from __future__ import annotations

from aserve.config import cpu_has_native_bf16


def test_native_bf16_is_read_from_the_cpu_flags(tmp_path, monkeypatch):
    monkeypatch.delenv("ASERVE_CPU_BF16", raising=False)
    amx = tmp_path / "amx"
    amx.write_text("processor : 0\nflags\t\t: fpu sse avx2 avx512f amx_bf16 amx_tile\n")
    avx512 = tmp_path / "avx512"
    avx512.write_text("processor : 0\nflags\t\t: fpu avx512f avx512_bf16\n")
    avx2 = tmp_path / "avx2"
    avx2.write_text("processor : 0\nflags\t\t: fpu sse avx2 fma\n")
    assert cpu_has_native_bf16(str(amx)) and cpu_has_native_bf16(str(avx512))
    assert not cpu_has_native_bf16(str(avx2))
    assert not cpu_has_native_bf16(str(tmp_path / "missing"))


def test_environment_overrides_the_probe(tmp_path, monkeypatch):
    avx2 = tmp_path / "avx2"
    avx2.write_text("flags\t\t: fpu sse avx2 fma\n")
    monkeypatch.setenv("ASERVE_CPU_BF16", "1")
    assert cpu_has_native_bf16(str(avx2))
    monkeypatch.setenv("ASERVE_CPU_BF16", "0")
    assert not cpu_has_native_bf16("/proc/cpuinfo")
