"""``neuron_tp.plan.hardware``: the instance table is internally consistent and agrees with the
per-instance totals AWS publishes (independent of the per-chip figures the table is built from),
so a wrong chip count, a wrong per-chip figure or a wrong split over cores fails here."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from neuron_tp.plan import hardware as hw

GiB = 2**30

# Per-instance totals from the Neuron "Trn1/Trn1n Architecture" and "Inf2 Architecture" tables
# (Device Memory GiB, BF16 TFLOPS, FP32 TFLOPS, device memory bandwidth GiB/s).
INSTANCE_TOTALS = {
    "trn1.2xlarge": (32, 190, 47.5, 820),
    "trn1.32xlarge": (512, 3040, 760, 13120),
    "trn1n.32xlarge": (512, 3040, 760, 13120),
    "inf2.xlarge": (32, 190, 47.5, 820),
    "inf2.8xlarge": (32, 190, 47.5, 820),
    "inf2.24xlarge": (192, 1140, 285, 4920),
    "inf2.48xlarge": (384, 2280, 570, 9840),
}


def test_required_instances_present() -> None:
    assert set(INSTANCE_TOTALS) <= set(hw.INSTANCES)
    for name, inst in hw.INSTANCES.items():
        assert inst.name == name


@pytest.mark.parametrize("name", sorted(hw.INSTANCES))
def test_sources_and_positive_figures(name: str) -> None:
    inst = hw.INSTANCES[name]
    assert inst.sources and all(s.startswith("https://") for s in inst.sources)
    for field in dataclasses.fields(inst):
        value = getattr(inst, field.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            assert value > 0, field.name
    assert inst.peak_fp32_flops_per_core < inst.peak_flops_per_core
    assert inst.collective_latency < 1e-2  # seconds, not microseconds


def test_trn1_32xlarge_has_32_ranks() -> None:
    assert hw.get_instance("trn1.32xlarge").cores == 32
    # NeuronCore-v2 chips: two cores each, on every instance in the table.
    for inst in hw.INSTANCES.values():
        assert inst.cores == 2 * inst.chips


@pytest.mark.parametrize("name", sorted(INSTANCE_TOTALS))
def test_per_core_figures_add_up_to_published_instance_totals(name: str) -> None:
    inst = hw.INSTANCES[name]
    mem_gib, bf16_tflops, fp32_tflops, hbm_bw_gib = INSTANCE_TOTALS[name]
    assert inst.hbm_per_core * inst.cores == mem_gib * GiB
    assert inst.peak_flops_per_core * inst.cores == pytest.approx(bf16_tflops * 1e12)
    assert inst.peak_fp32_flops_per_core * inst.cores == pytest.approx(fp32_tflops * 1e12)
    assert inst.hbm_bandwidth_per_core * inst.cores == pytest.approx(hbm_bw_gib * GiB)


def test_same_chip_same_per_core_figures() -> None:
    per_core = {
        (i.hbm_per_core, i.hbm_bandwidth_per_core, i.peak_flops_per_core)
        for i in hw.INSTANCES.values()
    }
    assert len(per_core) == 1  # Trainium and Inferentia2 publish identical chip figures


def test_trn1n_doubles_trn1_network() -> None:
    trn1, trn1n = hw.get_instance("trn1.32xlarge"), hw.get_instance("trn1n.32xlarge")
    assert trn1n.network_bandwidth == pytest.approx(2 * trn1.network_bandwidth)
    assert trn1.efa and trn1n.efa
    # EFA: only the 32xlarge Trainium sizes run multi-node jobs.
    assert {n for n, i in hw.INSTANCES.items() if i.efa} == {"trn1.32xlarge", "trn1n.32xlarge"}


def test_node_bandwidths_are_ordered() -> None:
    for inst in hw.INSTANCES.values():
        # One core cannot move data to its neighbours faster than its own HBM serves it.
        assert inst.link_bandwidth_per_core <= inst.hbm_bandwidth_per_core
        # Across nodes is slower than within a node, per core.
        assert inst.network_bandwidth / inst.cores < inst.link_bandwidth_per_core
    inf2 = [hw.get_instance(f"inf2.{s}").network_bandwidth for s in ("xlarge", "8xlarge")]
    inf2 += [hw.get_instance(f"inf2.{s}").network_bandwidth for s in ("24xlarge", "48xlarge")]
    assert inf2 == sorted(inf2)


def test_unknown_instance_lists_names() -> None:
    with pytest.raises(ValueError) as err:
        hw.get_instance("nope")
    assert "nope" in str(err.value)
    for name in hw.INSTANCES:
        assert name in str(err.value)


def test_instances_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        hw.get_instance("trn1.32xlarge").cores = 1  # type: ignore[misc]


def test_hardware_does_not_import_torch() -> None:
    tree = ast.parse(Path(hw.__file__).read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m.split(".")[0] == "torch" for m in modules)
