"""The EC2 Trainium/Inferentia2 instance table the job planner (``neuron-tp plan``) predicts
per-NeuronCore memory and step time from. One rank runs per NeuronCore, so every figure is per
core (a chip's figure split over its two NeuronCore-v2) or per node (network).

Units are SI: bytes, bytes/s, FLOP/s, seconds. AWS publishes memory in GiB and bandwidths in
GiB/s (so 1 GiB = 2**30 bytes here), FLOPS in TFLOPS (1e12) and network in Gbps (1e9 bit/s).
Each figure cites its source (URL + what the page says); figures AWS does not publish are
marked ASSUMPTION with the value used. All are peak (datasheet) figures, not measured ones.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30
TFLOPS = 1e12
Gbps = 1e9 / 8  # bytes/s

# Sources (read 2026; "latest" Neuron docs).
TRAINIUM = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/trainium.html"  # noqa: E501
INFERENTIA2 = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/inferentia2.html"  # noqa: E501
TRN1_ARCH = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/trn1-arch.html"  # noqa: E501
INF2_ARCH = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/inf2-arch.html"  # noqa: E501
MULTI_NODE = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/frameworks/torch/torch-neuronx/setup-trn1-multi-node-execution.html"  # noqa: E501
NCCOM_TEST = (
    "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/tools/neuron-sys-tools/nccom-test.html"  # noqa: E501
)
INF2_PRODUCT = "https://aws.amazon.com/ec2/instance-types/inf2/"
TRN1_BLOG = "https://aws.amazon.com/blogs/machine-learning/scaling-distributed-training-with-aws-trainium-and-amazon-eks/"  # noqa: E501

# --- Per chip. Trainium and Inferentia2 publish the same chip figures. -----------------------
CORES_PER_CHIP = 2  # TRAINIUM: "each Trainium include 2 x NeuronCore-v2"; INFERENTIA2: "each
# with two NeuronCore-v2 cores".
CHIP_BF16 = 190 * TFLOPS  # TRAINIUM, INFERENTIA2: "Two NeuronCore-v2 delivering ... 190
# FP16/BF16/cFP8/TF32 TFLOPS". (An older Trn1 page said 210; the current pages say 190.)
CHIP_FP32 = 47.5 * TFLOPS  # same pages: "... and 47.5 FP32 TFLOPS".
CHIP_HBM = 32 * GiB  # TRAINIUM: "32 GiB of device memory"; INFERENTIA2: "32GiB of HBM".
CHIP_HBM_BW = 820 * GiB  # same pages: "with 820 GiB/sec of bandwidth".
CHIP_DMA_BW = 1e12  # same pages: "1 TB/sec of DMA bandwidth".
# NeuronLink-v2 chip-to-chip, per chip: TRN1_ARCH table column "NeuronLink-v2 device-to-device
# (GiB/sec/device)": trn1.32xlarge 384, trn1n.32xlarge 768, trn1.2xlarge N/A; INF2_ARCH column
# "NeuronLink-v2 chip-to-chip (GiB/sec/chip)": inf2.24xlarge / inf2.48xlarge 192, 1-chip N/A.
LINK_TRN1, LINK_TRN1N, LINK_INF2 = 384 * GiB, 768 * GiB, 192 * GiB
# ASSUMPTION: a chip's NeuronLink bandwidth is shared evenly by its two cores (the pages give
# no per-core or per-direction split); the per-core figure is the chip's / 2.
# ASSUMPTION (1-chip instances, no NeuronLink): the two cores exchange data through the chip's
# shared HBM by DMA; a copy reads and writes HBM, so per core: HBM bandwidth per core / 2
# (= 205 GiB/s, under the DMA engines' 1 TB/s / 2). No on-chip core-to-core figure is published.
ON_CHIP_LINK = min(CHIP_HBM_BW / CORES_PER_CHIP / 2, CHIP_DMA_BW / CORES_PER_CHIP)
# ASSUMPTION: fixed cost of one collective op. AWS publishes no collective latency; nccom-test
# (NCCOM_TEST) measures it. 50 us is an order-of-magnitude placeholder to calibrate with a
# small-message `nccom-test allr` on the target instance. (Its doc example, 2 ranks, 32 MB
# all-reduce: 768 us, 40.69 GB/s bus bandwidth - far below the peak link figures above.)
COLLECTIVE_LATENCY = 50e-6


@dataclass(frozen=True)
class Instance:
    """One EC2 instance type as the planner sees it: one rank per NeuronCore."""

    name: str
    chips: int
    cores: int  # NeuronCores = ranks per node
    hbm_per_core: int  # bytes of device memory one core (rank) can use
    hbm_bandwidth_per_core: float  # bytes/s
    peak_flops_per_core: float  # dense BF16 FLOP/s
    peak_fp32_flops_per_core: float  # FLOP/s
    # bytes/s one core can send to the others in its node: NeuronLink-v2 (chip's figure / 2,
    # ASSUMPTION) on multi-chip instances, ON_CHIP_LINK (ASSUMPTION) on 1-chip instances.
    link_bandwidth_per_core: float
    network_bandwidth: float  # bytes/s per node across nodes (EFA on trn1/trn1n, else ENA)
    efa: bool  # multi-node training supported (EFA)
    collective_latency: float  # seconds per collective op (ASSUMPTION, see COLLECTIVE_LATENCY)
    sources: tuple[str, ...]  # URLs


def _node(
    name: str, chips: int, link_per_chip: float | None, network: float, efa: bool, *sources: str
) -> Instance:
    """An instance of ``chips`` Trainium/Inferentia2 chips; per-core figures from the chip's."""
    link = ON_CHIP_LINK if link_per_chip is None else link_per_chip / CORES_PER_CHIP
    return Instance(
        name=name,
        chips=chips,
        cores=chips * CORES_PER_CHIP,
        hbm_per_core=CHIP_HBM // CORES_PER_CHIP,
        hbm_bandwidth_per_core=CHIP_HBM_BW / CORES_PER_CHIP,
        peak_flops_per_core=CHIP_BF16 / CORES_PER_CHIP,
        peak_fp32_flops_per_core=CHIP_FP32 / CORES_PER_CHIP,
        link_bandwidth_per_core=link,
        network_bandwidth=network,
        efa=efa,
        collective_latency=COLLECTIVE_LATENCY,
        sources=sources,
    )


_TRN = (TRAINIUM, TRN1_ARCH, MULTI_NODE, TRN1_BLOG, NCCOM_TEST)
_INF = (INFERENTIA2, INF2_ARCH, INF2_PRODUCT, NCCOM_TEST)

INSTANCES: dict[str, Instance] = {
    i.name: i
    for i in (
        # TRN1_ARCH table: 1 Trainium, 32 GiB, 820 GiB/s, NeuronLink N/A. MULTI_NODE: "EFA is
        # currently not available on the smaller instances sizes and they cannot be used for
        # running multi-node jobs." Network: TRN1_BLOG table "Network Bandwidth (Gbps)":
        # trn1.2xlarge "Up to 12.5" (a burst figure). TRN1_ARCH lists "up-to 25" under "EFA
        # bandwidth (Gbps)" for this size, contradicting MULTI_NODE; the lower figure is used.
        _node("trn1.2xlarge", 1, None, 12.5 * Gbps, False, *_TRN),
        # TRN1_ARCH: 16 Trainium, 512 GiB, 13,120 GiB/s, NeuronLink 384 GiB/s/chip, EFA 800
        # Gbps; MULTI_NODE: "trn1.32xlarge has 8 EFA devices, trn1n.32xlarge has 16"; TRN1_BLOG:
        # "EFA networking that provides 800 Gbps ... per instance", trn1n "1600 Gbps".
        _node("trn1.32xlarge", 16, LINK_TRN1, 800 * Gbps, True, *_TRN),
        # TRN1_ARCH: as trn1.32xlarge but NeuronLink 768 GiB/s/chip and EFA "1,600" Gbps.
        _node("trn1n.32xlarge", 16, LINK_TRN1N, 1600 * Gbps, True, *_TRN),
        # INF2_ARCH table: xlarge / 8xlarge 1 chip, 32 GiB, 820 GiB/s, NeuronLink N/A;
        # 24xlarge 6 chips, 192 GiB, 4920 GiB/s; 48xlarge 12 chips, 384 GiB, 9840 GiB/s;
        # NeuronLink 192 GiB/s/chip. No EFA on Inf2: NCCOM_TEST "On Inf2 instances, only
        # single-instance benchmarking is supported"; the EFA column is absent for Inf2.
        # Network (ENA): INF2_PRODUCT lists up to 15, up to 25, 50 and 100 Gbps for xlarge,
        # 8xlarge, 24xlarge, 48xlarge. Found only as a third-party restatement of that AWS
        # page in this session, not read on the AWS page itself: verify before relying on it.
        _node("inf2.xlarge", 1, None, 15 * Gbps, False, *_INF),
        _node("inf2.8xlarge", 1, None, 25 * Gbps, False, *_INF),
        _node("inf2.24xlarge", 6, LINK_INF2, 50 * Gbps, False, *_INF),
        _node("inf2.48xlarge", 12, LINK_INF2, 100 * Gbps, False, *_INF),
    )
}


def get_instance(name: str) -> Instance:
    """The instance called ``name``; ValueError naming the valid names otherwise."""
    try:
        return INSTANCES[name]
    except KeyError:
        raise ValueError(
            f"unknown instance type {name!r}; known: {', '.join(sorted(INSTANCES))}"
        ) from None
