"""cpu_has_native_bf16 and cpu_bf16_is_fast: /proc/cpuinfo flags, the C kernels, the ASERVE_CPU_BF16 override."""

from __future__ import annotations

from aserve.config import cpu_bf16_is_fast, cpu_has_native_bf16


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


def test_bf16_is_fast_with_native_units_or_avx2_and_the_c_kernels(tmp_path, monkeypatch):
    """AVX2 + FMA + F16C CPUs multiply bf16 weights in aserve's C kernels (fp32 FMAs), faster than float32;
    without the kernels (switched off, no compiler) or those flags, torch's emulated bf16 is slower."""
    for name in ("ASERVE_CPU_BF16", "ASERVE_CPU_KERNELS", "ASERVE_FORCE_NATIVE_OPS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CC", "sh")  # any program on PATH stands for the compiler
    avx2, old = tmp_path / "avx2", tmp_path / "avx"
    avx2.write_text("flags\t\t: fpu sse avx avx2 fma f16c\n")
    old.write_text("flags\t\t: fpu sse avx avx2 fma\n")  # no F16C: the 4-bit scales cannot be widened
    native = tmp_path / "native"
    native.write_text("flags\t\t: fpu avx512f avx512_bf16\n")
    assert cpu_bf16_is_fast(str(avx2)) and cpu_bf16_is_fast(str(native))
    assert not cpu_bf16_is_fast(str(old)) and not cpu_bf16_is_fast(str(tmp_path / "missing"))
    monkeypatch.setenv("ASERVE_CPU_KERNELS", "0")
    assert not cpu_bf16_is_fast(str(avx2)) and cpu_bf16_is_fast(str(native))
    monkeypatch.delenv("ASERVE_CPU_KERNELS")
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert not cpu_bf16_is_fast(str(avx2))
    monkeypatch.setenv("ASERVE_CPU_BF16", "0")  # the override decides either way
    assert not cpu_bf16_is_fast(str(native))
    monkeypatch.setenv("ASERVE_CPU_BF16", "1")
    assert cpu_bf16_is_fast(str(old))
