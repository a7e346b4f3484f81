"""What a measurement says about its machine: the widest vector extension beside the model
name (two 'AMD EPYC' of one name ran ORT's 4-bit kernels at 1.27x and 0.81x of float32)."""

from __future__ import annotations

from mha_onnx.profile.roofline import cpu_isa, cpu_vendor, machine_info


def _cpuinfo(flags: str) -> str:
    return f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 {flags}\n\n"


def test_the_widest_extension_is_named():
    assert cpu_isa(_cpuinfo("avx2 avx512f avx512_vnni amx_tile")) == "AMX"
    assert cpu_isa(_cpuinfo("avx2 avx512f avx512_vnni")) == "AVX-512 VNNI"
    assert cpu_isa(_cpuinfo("avx2 avx_vnni")) == "AVX-VNNI"  # (256-bit int8 dot products)
    assert cpu_isa(_cpuinfo("avx2 avx512f")) == "AVX-512"
    assert cpu_isa(_cpuinfo("avx avx2")) == "AVX2"


def test_a_machine_that_does_not_say_gives_none():
    assert cpu_isa(_cpuinfo("sse4_2")) is None
    assert cpu_isa("") is None  # (no flags line: not x86, or no /proc)
    assert cpu_vendor("") is None


def test_the_vendor_is_read():
    text = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: avx2\n"
    assert cpu_vendor(text) == "GenuineIntel"
    assert cpu_vendor(_cpuinfo("avx2")) is None  # (the helper's text names no vendor)


def test_machine_info_carries_the_isa():
    info = machine_info()
    assert info["isa"] in {None, "AMX", "AVX-512 VNNI", "AVX-VNNI", "AVX-512", "AVX2"}
    assert info["isa"] == cpu_isa()
