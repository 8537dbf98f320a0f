"""kernel_facts (kernels/facts.py): the facts that decide a backend's bits, as the job compares them.

Checked: on cpu the default backend's facts are cpp's, its numerics version and the bf16 dot
flavour of the instruction set it runs, the very values its extension module reports; asking
again gives the same dict (the job compares two of them); another backend gives other facts,
so a rollout and a trainer on different backends cannot pass the job's comparison; triton's
facts (under its interpreter on a CPU) name the numerics, Triton's version, the pinned
FP-fusion setting and the mode. The native facts' values: tests/kernels/native/test_platform_probe.py.
"""

import pytest

from rl_engine.kernels import list_backends
from rl_engine.kernels.cpp._extension import NUMERICS_VERSION, bf16_dot_flavour, current_isa
from rl_engine.kernels.facts import kernel_facts
from tests.helpers.triton_marks import DEVICE, TRITON_MARKS


def test_the_default_cpu_facts_are_cpps():
    assert list_backends("cpu")[0] == "cpp"
    facts = kernel_facts("cpu")
    assert facts == {
        "backend": "cpp",
        "cpp_numerics": NUMERICS_VERSION,
        "cpp_bf16_dot": bf16_dot_flavour(current_isa()),
    }
    assert kernel_facts("cpu") == facts == kernel_facts("cpu", backend="cpp")


def test_another_backend_gives_other_facts():
    cpp, native = kernel_facts("cpu", backend="cpp"), kernel_facts("cpu", backend="native")
    assert native != cpp and native["backend"] == "native"
    assert all(isinstance(value, str) for value in native.values())


def _triton(test):
    for mark in TRITON_MARKS:
        test = mark(test)
    return test


@_triton
def test_triton_facts_name_the_compiler_and_its_mode():
    import triton

    facts = kernel_facts(DEVICE, backend="triton")
    assert facts["backend"] == "triton" and facts["triton_version"] == triton.__version__
    assert facts["triton_fp_fusion"] == "off"  # pinned at every launch
    assert facts["triton_mode"] == ("interpreter" if DEVICE == "cpu" else "compiled")
    assert facts["triton_numerics"].startswith("tritonk-")


def test_a_backend_that_does_not_serve_the_device_is_refused_by_name():
    with pytest.raises(ValueError, match=r"backend 'bogus' does not serve device 'cpu'.*cpp"):
        kernel_facts("cpu", backend="bogus")
