"""GPU presets and size parsing of the simulated backend."""

import pytest

from bootstrap.backends.sim.gpus import CUDA_CONTEXT_BYTES, SIM_GPUS, parse_bytes, resolve_sim_gpu, sim_device

MiB = 1024**2


def test_h200_preset_is_the_measured_torch_total():
    device = sim_device("h200")
    assert device.total_bytes() == 150_109_880_320
    assert device.free_bytes() == 150_109_880_320 - CUDA_CONTEXT_BYTES
    assert device.allocated_bytes() == 0


@pytest.mark.parametrize("name", sorted(SIM_GPUS))
def test_every_preset_is_below_its_nvidia_smi_size(name):
    nvidia_smi_mib = {
        "h200": 143_771,
        "h100-80gb": 81_559,
        "a100-80gb": 81_920,
        "a100-40gb": 40_960,
        "l40s": 46_068,
        "rtx-4090": 24_564,
    }
    gpu = SIM_GPUS[name]
    assert 0.98 * nvidia_smi_mib[name] * MiB < gpu.total_bytes <= nvidia_smi_mib[name] * MiB
    assert gpu.source


def test_preset_names_are_case_insensitive_and_devices_are_fresh():
    a, b = sim_device("H100-80GB"), sim_device("h100-80gb")
    a.allocate(MiB, "x")
    assert b.allocated_bytes() == 0
    assert a.total_bytes() == b.total_bytes() == 81_089 * MiB


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("custom:80GiB", 80 * 1024**3),
        ("80GiB", 80 * 1024**3),
        ("85899345920", 85_899_345_920),
        ("80GB", 80 * 10**9),
        ("1.5 TiB", int(1.5 * 1024**4)),
        ("custom:40960MiB", 40_960 * MiB),
    ],
)
def test_custom_sizes(text, expected):
    device = sim_device(text)
    assert device.total_bytes() == expected
    assert device.non_torch == CUDA_CONTEXT_BYTES


@pytest.mark.parametrize("text", ["h300", "custom:", "gpu", "custom:80XB", "0", "custom:-5GiB", "1MiB"])
def test_bad_gpu_names_are_rejected_with_the_presets(text):
    with pytest.raises(ValueError) as err:
        resolve_sim_gpu(text)
    message = str(err.value)
    assert repr(text) in message or text in message
    if not text[:1].isdigit() and not text.startswith("custom:"):
        assert all(name in message for name in SIM_GPUS)


def test_parse_bytes_rejects_unknown_units():
    with pytest.raises(ValueError, match="GiB"):
        parse_bytes("12 parsecs")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8.2MB", 8_200_000),
        ("16TiB", 16 * 1024**4),
        ("17592186044416", 16 * 1024**4),
        ("1.000000000001TiB", 1024**4 + 1),
        ("0.000000000001TiB", 1),
    ],
)
def test_byte_counts_are_exact_not_rounded_through_float(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["100000000000000000000000000000", "1" + "0" * 400, "16.001TiB", "0.5"])
def test_byte_counts_outside_the_range_name_it(text):
    with pytest.raises(ValueError) as err:
        parse_bytes(text)
    expected = f"a simulated GPU size must be in [1 byte, 16 TiB] ([1, 17592186044416] bytes), got {text!r}"
    assert str(err.value) == expected
