"""The scatter kernel compiles warning-free with NVRTC and its structs match pack.py.

No GPU needed: NVRTC only compiles. When cuda-python or NVRTC is missing these
tests fail under CI (``CI`` set) and skip elsewhere.
"""

from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest

from cucopy import kernels, pack

ARCHS = ("sm_80", "sm_90")

STRUCTS = {
    "CucopyHeader": pack.HEADER_DTYPE,
    "CucopyDesc": pack.DESC_DTYPE,
    "CucopyFeedEntry": pack.FEED_ENTRY_DTYPE,
}

# NVRTC has no <cstddef>.
_PRELUDE = "#define CUCOPY_OFFSETOF(T, f) __builtin_offsetof(T, f)\n"


def _nvrtc_or_skip():
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        try:
            from cuda import nvrtc
        except ImportError as exc:
            reason = f"cuda-python (NVRTC bindings) is not importable: {exc}"
            if os.environ.get("CI"):
                pytest.fail(reason + " (CI must install the nvrtc extra)")
            pytest.skip(reason)
    try:
        err, *_ = nvrtc.nvrtcVersion()
    except Exception as exc:  # the binding loads libnvrtc lazily
        err = exc
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        reason = f"libnvrtc cannot be loaded: {err}"
        if os.environ.get("CI"):
            pytest.fail(reason + " (CI must install nvidia-cuda-nvrtc)")
        pytest.skip(reason)


@pytest.fixture
def nvrtc():
    """Skip (or, under CI, fail) when NVRTC is unavailable."""
    _nvrtc_or_skip()


def layout_asserts(structs=STRUCTS) -> str:
    """``static_assert`` lines pinning each struct's size and field offsets to ``structs``."""
    lines = []
    for name, dtype in structs.items():
        lines.append(
            f'static_assert(sizeof({name}) == {dtype.itemsize}, "{name}: size != {dtype.itemsize}");'
        )
        for fname, (fdtype, offset) in dtype.fields.items():
            lines.append(
                f"static_assert(CUCOPY_OFFSETOF({name}, {fname}) == {offset}, "
                f'"{name}.{fname}: offset != {offset}");'
            )
            lines.append(
                f"static_assert(sizeof((({name}*)0)->{fname}) == {fdtype.itemsize}, "
                f'"{name}.{fname}: size != {fdtype.itemsize}");'
            )
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("arch", ARCHS)
def test_compiles_warning_free(nvrtc, arch):
    ptx = kernels.compile_ptx(arch)
    assert f".target {arch}" in ptx
    for entry in kernels.ENTRY_POINTS:
        assert f".entry {entry}(" in ptx, f"{entry} missing from the {arch} PTX"


def test_source_is_packaged_text():
    src = kernels.source()
    for entry in kernels.ENTRY_POINTS:
        assert f"{entry}(" in src or f"CUCOPY_CARRIED_ENTRY({entry}," in src
    assert "struct CucopyHeader" in src and "struct CucopyDesc" in src


def test_entry_bits_follow_entry_points():
    # bit i of CUCOPY_ENTRIES guards ENTRY_POINTS[i] in scatter.cu
    src = kernels.source()
    guards = re.findall(
        r"#if CUCOPY_BUILDS\((\d+)\)\n(?:extern \"C\"[^\n]*\n(\w+)\(|CUCOPY_CARRIED_ENTRY\((\w+),)",
        src,
    )
    assert [(int(i), a or b) for i, a, b in guards] == list(enumerate(kernels.ENTRY_POINTS))
    assert kernels.entry_mask(["cucopy_fill", "cucopy_scatter_c1k"]) == 0b110
    with pytest.raises(ValueError, match="'cucopy_nope' is not a kernel of scatter.cu"):
        kernels.entry_mask(["cucopy_nope"])


@pytest.mark.parametrize(
    "entry", ["cucopy_scatter", "cucopy_fill", "cucopy_scatter_c1k", "cucopy_scatter_c32k"]
)
def test_one_entry_point_builds_alone_warning_free(nvrtc, entry):
    # the CUDA backend compiles each entry point as a module of its own
    ptx = kernels.compile_ptx("sm_90", code=kernels.source([entry]))
    assert re.findall(r"\.entry (\w+)\(", ptx) == [entry]


def test_a_selected_build_keeps_the_file_s_line_numbers(nvrtc):
    code = kernels.source(["cucopy_fill"]).replace(
        "#define CUCOPY_THREADS 256", "#define CUCOPY_THREADS 256\n#error here", 1
    )
    line = kernels.source().splitlines().index("#define CUCOPY_THREADS 256") + 2
    with pytest.raises(RuntimeError, match=rf"scatter\.cu\({line}\): [a-z ]*error"):
        kernels.compile_ptx("sm_90", code=code)


def carry_asserts(capacities=pack.CARRY_CAPACITIES, prefix=pack.CARRY_PREFIX) -> str:
    """``static_assert`` lines pinning each carried parameter buffer to pack.py."""
    lines = []
    for cap in capacities:
        t = f"CucopyCarried<{cap}>"
        lines.append(
            f'static_assert(sizeof({t}) == {prefix + cap}, "{t}: size != {prefix + cap}");'
        )
        lines.append(
            f'static_assert(CUCOPY_OFFSETOF({t}, bytes) == {prefix}, "{t}.bytes: offset != {prefix}");'
        )
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("arch", ARCHS)
def test_structs_match_pack_layout(nvrtc, arch):
    code = _PRELUDE + kernels.source() + "\n" + layout_asserts() + carry_asserts()
    kernels.compile_ptx(arch, code=code, name="layout_check.cu")


def feed_asserts() -> str:
    """``static_assert`` lines pinning the graph feed's mailbox constants to pack.py."""
    pairs = {
        "CUCOPY_FEED_HEAD": pack.FEED_HEAD_BYTES,
        "CUCOPY_FEED_ENTRY_BYTES": pack.FEED_ENTRY_BYTES,
        "CUCOPY_FEED_CAPACITY": pack.FEED_CAPACITY,
        "CUCOPY_FEED_MAX": pack.FEED_MAX,
        "CUCOPY_FEED_LANE": pack.FEED_LANE_BYTES,
    }
    return "".join(f'static_assert({k} == {v}, "{k} != {v}");\n' for k, v in pairs.items())


@pytest.mark.parametrize("arch", ARCHS)
def test_feed_layout_matches_pack(nvrtc, arch):
    code = _PRELUDE + kernels.source() + "\n" + feed_asserts()
    kernels.compile_ptx(arch, code=code, name="feed_check.cu")
    # CUCOPY_BUILDS(19) guards the feed kernel in scatter.cu
    assert kernels.ENTRY_POINTS.index(pack.FEED_ENTRY_POINT) == 19
    assert pack.FEED_CAPACITY % pack.ALIGN == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_graphed_kernel_matches_pack(nvrtc, arch):
    # CUCOPY_BUILDS(20) guards it; its capacity is pack's, in whole rounds of loads
    code = (
        _PRELUDE
        + kernels.source([pack.GRAPH_ENTRY_POINT])
        + f'\nstatic_assert(CUCOPY_GRAPH_CAP == {pack.GRAPH_CAPACITY}, "graph capacity");\n'
    )
    ptx = kernels.compile_ptx(arch, code=code, name="graph_check.cu")
    assert pack.GRAPH_ENTRY_POINT in ptx
    assert kernels.ENTRY_POINTS.index(pack.GRAPH_ENTRY_POINT) == 20
    assert pack.GRAPH_CAPACITY % (16 * pack.THREADS) == 0


@pytest.mark.parametrize("spread, cap", [(0, 8192), (1, 8192), (1, 16384), (1, 32768)])
def test_graphed_kernel_variants_build_warning_free(nvrtc, spread, cap):
    # bench/probes/graph_kernel.py builds these on a GPU; the source must keep taking them
    code = f"#define CUCOPY_GRAPH_SPREAD {spread}\n#define CUCOPY_GRAPH_CAP {cap}u\n"
    code += kernels.source([pack.GRAPH_ENTRY_POINT])
    code += f"\nstatic_assert(CUCOPY_GRAPH_CAP == {cap}u && CUCOPY_GRAPH_SPREAD == {spread});\n"
    ptx = kernels.compile_ptx("sm_90", code=code, name="graph_variant.cu")
    assert re.findall(r"\.entry (\w+)\(", ptx) == [pack.GRAPH_ENTRY_POINT]
    # the shared bytes: room for the longest segment read whole (pack.graph_max: four
    # times the copier's capacity, twice 16 KiB, a 32 KiB capacity alone)
    room = pack.graph_max(cap)
    assert room == {8192: 32768, 16384: 32768, 32768: 32768}[cap]
    assert re.search(rf"\.shared \.align 16 \.b8 \w+\[{room}\]", ptx), ptx[:2000]


def test_carry_layout_check_is_not_vacuous(nvrtc):
    code = _PRELUDE + kernels.source() + "\n" + carry_asserts(capacities=(1000,))
    with pytest.raises(RuntimeError, match=r"CucopyCarried<1000>: size != 1016"):
        kernels.compile_ptx("sm_90", code=code, name="layout_check.cu")


def test_carry_entry_points_match_pack():
    assert len(pack.CARRY_ENTRY_POINTS) == len(pack.CARRY_CAPACITIES)
    assert list(pack.CARRY_CAPACITIES) == sorted(pack.CARRY_CAPACITIES)
    src = kernels.source()
    for name, cap in zip(pack.CARRY_ENTRY_POINTS, pack.CARRY_CAPACITIES):
        assert f"CUCOPY_CARRIED_ENTRY({name}, {cap})" in src
        assert name in kernels.ENTRY_POINTS
        assert cap % pack.ALIGN == 0
    # under CUDA's 32764-byte limit on a launch's parameters
    assert pack.CARRY_PREFIX + pack.CARRY_CAPACITIES[-1] <= 32764


def test_carry_capacity_picks_the_smallest_that_holds():
    caps = pack.CARRY_CAPACITIES
    assert pack.carry_capacity(1) == caps[0]
    assert pack.carry_capacity(caps[0]) == caps[0]
    assert pack.carry_capacity(caps[0] + 1) == caps[1]
    assert pack.carry_capacity(caps[-1]) == caps[-1]
    assert pack.carry_capacity(caps[-1] + 1) == 0
    assert pack.carry_capacity(5000, caps[:2]) == 0


def test_layout_check_is_not_vacuous(nvrtc):
    # The same check against a descriptor whose dst and src trade places must
    # not compile: the generated asserts really reach the compiler.
    descr = pack.DESC_DTYPE.descr
    swapped = np.dtype([descr[1], descr[0], *descr[2:]])
    code = _PRELUDE + kernels.source() + "\n" + layout_asserts({"CucopyDesc": swapped})
    with pytest.raises(RuntimeError, match=r"CucopyDesc\.dst: offset != 8"):
        kernels.compile_ptx("sm_90", code=code, name="layout_check.cu")


def test_layout_check_catches_size_change(nvrtc):
    bigger = np.dtype([*pack.HEADER_DTYPE.descr, ("pad", "<u8")])
    code = _PRELUDE + kernels.source() + "\n" + layout_asserts({"CucopyHeader": bigger})
    with pytest.raises(RuntimeError, match=r"CucopyHeader: size != 40"):
        kernels.compile_ptx("sm_90", code=code, name="layout_check.cu")


def test_warnings_are_errors(nvrtc):
    with pytest.raises(RuntimeError, match=r"warning"):
        kernels.compile_ptx("sm_90", code="__global__ void f() { int unused; }\n")


def test_compile_error_carries_log(nvrtc):
    with pytest.raises(RuntimeError, match=r"(?s)NVRTC_ERROR_COMPILATION.*broken\.cu.*error"):
        kernels.compile_ptx("sm_90", code="__global__ void f() { int x = ; }\n", name="broken.cu")


def test_importing_kernels_does_not_import_cuda_python():
    import subprocess

    code = (
        "import sys, cucopy.kernels as k; k.source(); "
        "bad = [m for m in sys.modules if m == 'cuda' or m.startswith(('cuda.', 'cupy'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_compiling_leaves_the_interpreter_s_shared_bytes_alone(nvrtc):
    """NVRTC writes into the log buffer: it must never be an interned one-byte bytes."""
    kernels.compile_ptx("sm_90")
    assert bytes([32])[0] == 32 and (b" " * 1)[0] == 32
