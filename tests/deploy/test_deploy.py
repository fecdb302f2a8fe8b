"""Deployment artefacts: Dockerfile and k8s/ manifests, validated offline.

The manifests are templates with ${VAR} placeholders whose values live in k8s/params.env (one
place for image, node count, TP degree); k8s/render.sh substitutes them. These tests render
every template (plain and with the trn1n override), then check them against independent
references: the Kubernetes OpenAPI schemas (kubernetes-validate), the Kubeflow training
operator's admission rules, torchrun's own argument parser, the training and generation
scripts' own parsers, AWS instance facts, hadolint and checkov.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
TEMPLATES = ("cluster", "train", "precompile", "consolidate", "inference", "selftest")
VARIANTS = {"trn1": (), "trn1n": ("trn1n.env",)}
IMAGE_ROOT = "/opt/neuron_tp"  # WORKDIR of the Dockerfile: scripts/ is copied below it
# AWS instance facts (Neuron devices, NeuronCores, EFA interfaces), not taken from the manifests.
INSTANCES = {
    "trn1.32xlarge": (16, 32, 8),
    "trn1n.32xlarge": (16, 32, 16),
    "inf2.xlarge": (1, 2, 0),
    "inf2.8xlarge": (1, 2, 0),
    "inf2.24xlarge": (6, 12, 0),
    "inf2.48xlarge": (12, 24, 0),
}
VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def load_params(*overrides: str) -> dict[str, str]:
    """KEY=value lines of params.env then each override file (later files win)."""
    out: dict[str, str] = {}
    for name in ("params.env", *overrides):
        for line in (K8S / name).read_text().splitlines():
            if line and not line.startswith("#"):
                key, _, val = line.partition("=")
                out[key] = val
    return out


def render(template: str, *overrides: str) -> str:
    params = load_params(*overrides)
    text = (K8S / f"{template}.yaml").read_text()
    missing = set(VAR.findall(text)) - set(params)
    assert not missing, f"{template}.yaml uses undefined variables {sorted(missing)}"
    return VAR.sub(lambda m: params[m.group(1)], text)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request):
    """(overrides, params, {template: [documents]}) for one node type."""
    overrides = VARIANTS[request.param]
    docs = {t: [d for d in yaml.safe_load_all(render(t, *overrides)) if d] for t in TEMPLATES}
    return overrides, load_params(*overrides), docs


def one(docs, kind):
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def worker_template(job):
    return job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]


def argv(container) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def parse_launch(cmd: list[str], script: str):
    """Split `torchrun OPTS SCRIPT ARGS` with torchrun's own parser."""
    from torch.distributed.run import get_args_parser

    assert cmd[0] == "torchrun", cmd
    launch = get_args_parser().parse_args(cmd[1:])
    assert launch.training_script == f"{IMAGE_ROOT}/scripts/{script}"
    assert (REPO / "scripts" / script).is_file(), f"scripts/{script} missing from the repo"
    return launch, launch.training_script_args


def parse_module_launch(cmd: list[str], module: str):
    """Split `torchrun OPTS --module MODULE ARGS` with torchrun's own parser."""
    from torch.distributed.run import get_args_parser

    assert cmd[0] == "torchrun", cmd
    launch = get_args_parser().parse_args(cmd[1:])
    assert launch.module and launch.training_script == module, cmd
    return launch, launch.training_script_args


def env_of(container) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


# ----------------------------------------------------------------------------- rendering


def test_render_script_matches_and_rejects_bad_input(tmp_path):
    for template in TEMPLATES:
        for overrides in VARIANTS.values():
            out = subprocess.run(
                ["sh", str(K8S / "render.sh"), template, *[str(K8S / o) for o in overrides]],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            assert out.rstrip("\n") == render(template, *overrides).rstrip("\n"), template
    bad = subprocess.run(["sh", str(K8S / "render.sh"), "nonsense"], capture_output=True, text=True)
    assert bad.returncode == 2 and "|".join(TEMPLATES) in bad.stderr
    shutil.copytree(K8S, tmp_path / "k8s")
    (tmp_path / "k8s" / "broken.yaml").write_text("a: ${NOT_A_PARAM}\nb: ${TP}\n")
    unset = subprocess.run(
        ["sh", str(tmp_path / "k8s" / "render.sh"), "broken"], capture_output=True, text=True
    )
    assert unset.returncode == 1 and "NOT_A_PARAM" in unset.stderr


def test_params_are_the_one_place():
    params = load_params()
    used = set()
    for template in TEMPLATES:
        used |= set(VAR.findall((K8S / f"{template}.yaml").read_text()))
    assert set(params) == used, f"unused {set(params) - used}, undefined {used - set(params)}"
    for key, val in params.items():
        assert re.fullmatch(r"[A-Za-z0-9_./:,@+-]+", val), f"{key}={val!r}: plain values only"
    for overrides in VARIANTS.values():
        for name in overrides:
            assert set(load_params(name)) == set(params), f"{name} may only override keys"
    for template in TEMPLATES:  # image, node count and TP are never hard-coded in a template
        text = (K8S / f"{template}.yaml").read_text()
        assert not re.search(r"image:\s*[^$\s]", text)
        assert "--tp=${" in text or template in ("cluster", "consolidate")


# ----------------------------------------------------------------------------- schemas


def test_manifests_validate_against_kubernetes_schemas(variant):
    import kubernetes_validate as kv

    _, _, docs = variant
    version = kv.latest_version()
    checked = 0
    for items in docs.values():
        for doc in items:
            if doc["apiVersion"].startswith("kubeflow.org/"):
                for rtype, spec in doc["spec"]["pytorchReplicaSpecs"].items():
                    pt = {
                        "apiVersion": "v1",
                        "kind": "PodTemplate",
                        "metadata": {"name": f"{doc['metadata']['name']}-{rtype.lower()}"},
                        "template": spec["template"],
                    }
                    kv.validate(pt, version, strict=True)
                    checked += 1
            else:
                kv.validate(doc, version, strict=True)
                checked += 1
    assert checked >= 7
    with pytest.raises(kv.ValidationError):  # the validator does reject a broken pod spec
        job = one(docs["inference"], "Deployment")
        broken = json.loads(json.dumps(job))
        broken["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = [1]
        kv.validate(broken, version, strict=True)


def test_pytorchjobs_have_what_the_training_operator_requires(variant):
    _, params, docs = variant
    for template in ("train", "precompile"):
        job = one(docs[template], "PyTorchJob")
        name = job["metadata"]["name"]
        assert job["apiVersion"] == "kubeflow.org/v1"
        assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", name), "name must be DNS-1035"
        specs = job["spec"]["pytorchReplicaSpecs"]
        assert set(specs) <= {"Master", "Worker"} and "Worker" in specs
        if "Master" in specs:
            assert specs["Master"]["replicas"] == 1
        worker = specs["Worker"]
        assert worker["replicas"] == int(params["NNODES"]) >= 1
        assert worker["restartPolicy"] in {"Always", "OnFailure", "Never", "ExitCode"}
        containers = {c["name"]: c for c in worker["template"]["spec"]["containers"]}
        assert "pytorch" in containers and containers["pytorch"]["image"] == params["IMAGE"]
        elastic = job["spec"]["elasticPolicy"]
        assert elastic["rdzvBackend"] == "c10d"
        assert elastic["minReplicas"] == elastic["maxReplicas"] == worker["replicas"]
        ports = {p["name"]: p["containerPort"] for p in containers["pytorch"].get("ports", [])}
        port = elastic.get("rdzvPort", ports.get("pytorchjob-port"))
        assert "pytorchjob-port" in ports and port == ports["pytorchjob-port"]
        # the operator exports PET_RDZV_ENDPOINT=<job>-worker-0:<port>; the flags must agree
        cmd = argv(containers["pytorch"])
        launch, _ = parse_launch(cmd[cmd.index("torchrun") :], "train.py")
        assert launch.rdzv_backend == "c10d" and launch.rdzv_endpoint == f"{name}-worker-0:{port}"
        assert launch.nnodes == str(worker["replicas"])
        assert launch.max_restarts == elastic["maxRestarts"]


# ----------------------------------------------------------------------------- resources


def test_trainium_pods_request_all_devices_and_efa(variant):
    _, params, docs = variant
    pvc = one(docs["cluster"], "PersistentVolumeClaim")
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    for template in ("train", "precompile"):
        pod = worker_template(one(docs[template], "PyTorchJob"))["spec"]
        itype = pod["nodeSelector"]["node.kubernetes.io/instance-type"]
        devices, cores, efa = INSTANCES[itype]
        (c,) = pod["containers"]
        res = c["resources"]
        assert res["requests"] == res["limits"], "requests must equal limits"
        assert res["limits"]["aws.amazon.com/neuron"] == devices
        assert res["limits"]["vpc.amazonaws.com/efa"] == efa
        launch, _ = parse_launch(argv(c)[argv(c).index("torchrun") :], "train.py")
        env = env_of(c)
        per_process = int(env["NEURON_RT_NUM_CORES"]["value"])
        assert per_process * int(launch.nproc_per_node) == cores, "use every NeuronCore once"
        for k, v in {
            "FI_PROVIDER": "efa",
            "FI_EFA_USE_DEVICE_RDMA": "1",
            "FI_EFA_FORK_SAFE": "1",
            "MALLOC_ARENA_MAX": "64",
        }.items():
            assert env[k]["value"] == v, k
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        shared = [p for p, n in mounts.items() if "persistentVolumeClaim" in volumes[n]]
        assert len(shared) == 1
        assert (
            volumes[mounts[shared[0]]]["persistentVolumeClaim"]["claimName"]
            == pvc["metadata"]["name"]
        )
        # compile cache: on the shared volume, one directory per node slot (replica index),
        # and NEURON_CC_FLAGS well-formed (space-separated flags, cache_dir == cache URL)
        names = [e["name"] for e in c["env"]]
        index = env["REPLICA_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert index == "metadata.labels['training.kubeflow.org/replica-index']"
        cache = env["NEURON_COMPILE_CACHE_URL"]["value"]
        assert cache.startswith(shared[0] + "/") and cache.endswith("$(REPLICA_INDEX)")
        assert names.index("REPLICA_INDEX") < names.index("NEURON_COMPILE_CACHE_URL")
        flags = shlex.split(env["NEURON_CC_FLAGS"]["value"])
        assert all(re.fullmatch(r"--?[A-Za-z][-\w]*(=\S+)?", f) for f in flags), flags
        assert f"--cache_dir={cache}" in flags and "--model-type=transformer" in flags


def test_selftest_job_checks_every_core_of_the_training_nodes(variant):
    """k8s/selftest.yaml runs `neuron-tp selftest` (its own parser accepts the options) on the
    training job's nodes, devices, EFA, environment and compile cache, with its tp (so dp
    crosses the nodes), never restarted, writing the calibration to the shared volume."""
    from neuron_tp.cli.selftest import options_from_args, selftest_parser

    _, params, docs = variant
    job, train = one(docs["selftest"], "PyTorchJob"), one(docs["train"], "PyTorchJob")
    name = job["metadata"]["name"]
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == int(params["NNODES"]) and worker["restartPolicy"] == "Never"
    assert job["spec"]["elasticPolicy"]["maxRestarts"] == 0
    (c,) = worker["template"]["spec"]["containers"]
    (t,) = worker_template(train)["spec"]["containers"]
    launch, rest = parse_module_launch(argv(c), "neuron_tp.cli")
    train_launch, _ = parse_launch(argv(t)[argv(t).index("torchrun") :], "train.py")
    assert launch.nproc_per_node == train_launch.nproc_per_node and launch.max_restarts == 0
    assert launch.rdzv_endpoint == f"{name}-worker-0:{job['spec']['elasticPolicy']['rdzvPort']}"
    assert rest[0] == "selftest"
    options = options_from_args(selftest_parser().parse_args(rest[1:]))
    assert options.tp == int(params["TP"]) and options.device == "xla"
    assert options.instance == params["INSTANCE_TYPE"]
    assert options.calibrate.startswith("/shared/")  # the shared volume: kept after the pod
    assert c["resources"] == t["resources"]
    keep = ("NEURON_CC_FLAGS", "NEURON_COMPILE_CACHE_URL", "NEURON_RT_NUM_CORES", "FI_PROVIDER")
    for k in keep:
        assert env_of(c)[k] == env_of(t)[k], k
    spec, train_spec = worker["template"]["spec"], worker_template(train)["spec"]
    assert spec["nodeSelector"] == train_spec["nodeSelector"]


def test_train_command_parses_with_the_real_train_parser(variant):
    from neuron_tp.cli.args import train_parser

    _, params, docs = variant
    (c,) = worker_template(one(docs["train"], "PyTorchJob"))["spec"]["containers"]
    assert c["command"] == ["torchrun"]
    launch, script_args = parse_launch(argv(c), "train.py")
    args = train_parser().parse_args(script_args)
    world = int(launch.nnodes) * int(launch.nproc_per_node)
    assert args.tp == int(params["TP"]) and world % args.tp == 0
    assert args.device == "xla" and args.resume == "auto"
    assert args.output_dir.startswith("/shared/") and args.data.startswith("/shared/")
    with pytest.raises(SystemExit):  # the parser is strict: a misspelt option would not pass
        train_parser().parse_args([*script_args, "--tensor-parallel=8"])


def test_precompile_runs_the_same_command_under_neuron_parallel_compile(variant):
    from neuron_tp.cli.args import train_parser

    _, _, docs = variant
    train_job, pre_job = one(docs["train"], "PyTorchJob"), one(docs["precompile"], "PyTorchJob")
    (tc,) = worker_template(train_job)["spec"]["containers"]
    (pc,) = worker_template(pre_job)["spec"]["containers"]
    assert pc["command"] == ["neuron_parallel_compile"]
    t_launch, t_args = parse_launch(argv(tc), "train.py")
    p_launch, p_args = parse_launch(argv(pc)[1:], "train.py")
    t, p = vars(train_parser().parse_args(t_args)), vars(train_parser().parse_args(p_args))
    differ = {k for k in t if t[k] != p[k]}
    assert differ <= {"steps", "output_dir", "resume"}, differ
    assert p["resume"] == "none" and p["output_dir"] != t["output_dir"]
    assert p["steps"] <= t["steps"]
    t_l, p_l = vars(t_launch), vars(p_launch)
    assert {k for k in t_l if t_l[k] != p_l[k]} <= {
        "rdzv_id",
        "rdzv_endpoint",
        "training_script_args",
    }

    # identical pods otherwise: same nodes, devices, env (compile flags, cache dirs), volumes
    def strip(tmpl):
        return {
            **tmpl["spec"],
            "containers": [
                {k: v for k, v in c.items() if k not in ("command", "args")}
                for c in tmpl["spec"]["containers"]
            ],
        }

    assert strip(worker_template(train_job)) == strip(worker_template(pre_job))
    assert (
        train_job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]
        == pre_job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]
    )


def test_inference_serves_with_tp_over_neuroncores(variant):
    from neuron_tp.cli.args import serve_parser

    _, params, docs = variant
    deploy = one(docs["inference"], "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= labels.items()
    _, cores, _ = INSTANCES[pod["nodeSelector"]["node.kubernetes.io/instance-type"]]
    (c,) = pod["containers"]
    assert c["image"] == params["IMAGE"]
    res = c["resources"]
    assert res["requests"] == res["limits"]
    launch, script_args = parse_module_launch(argv(c), "neuron_tp.cli")
    assert script_args[0] == "serve"
    args = serve_parser().parse_args(script_args[1:])
    assert args.tp == int(launch.nproc_per_node) == res["limits"]["aws.amazon.com/neuroncore"]
    assert args.tp <= cores and launch.nnodes == "1" and args.device == "xla"
    assert args.buckets == sorted(set(args.buckets)) and args.buckets[0] > 0
    assert args.host == "0.0.0.0", "listen on the pod's address, not only on loopback"
    with pytest.raises(SystemExit):  # the parser is strict: a misspelt option would not pass
        serve_parser().parse_args([*script_args[1:], "--listen=0.0.0.0"])
    # the Service reaches the container port the server listens on
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == args.port
    svc = one(docs["inference"], "Service")
    assert svc["spec"]["selector"].items() <= labels.items()
    (sp,) = svc["spec"]["ports"]
    assert sp["targetPort"] in ("http", args.port)
    policy = one(docs["inference"], "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert [p["port"] for p in policy["spec"]["ingress"][0]["ports"]] == ["http"]


def test_inference_probes_hit_paths_the_server_serves(variant):
    from neuron_tp.infer.engine import Engine
    from neuron_tp.infer.server import create_app

    _, _, docs = variant
    (c,) = one(docs["inference"], "Deployment")["spec"]["template"]["spec"]["containers"]
    probes = {k: c[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"]["path"] == "/health"
    assert probes["readinessProbe"]["path"] == "/ready"
    app = create_app(Engine(), "probe-check")  # an engine without a model: not ready
    served = {r.path for r in app.routes if "GET" in getattr(r, "methods", ())}
    for kind, probe in probes.items():
        assert probe["path"] in served, f"{kind} path {probe['path']} is not served"
        assert probe["port"] in ("http", c["ports"][0]["containerPort"]), kind


def test_inference_is_scraped_and_takes_its_api_key_from_a_secret(variant):
    from neuron_tp.infer.engine import Engine
    from neuron_tp.infer.limits import API_KEY_ENV, OPEN_PATHS
    from neuron_tp.infer.server import create_app

    _, _, docs = variant
    template = one(docs["inference"], "Deployment")["spec"]["template"]
    (c,) = template["spec"]["containers"]
    notes = template["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert int(notes["prometheus.io/port"]) == c["ports"][0]["containerPort"]
    app = create_app(Engine(), "scrape-check")
    served = {r.path for r in app.routes if "GET" in getattr(r, "methods", ())}
    path = notes["prometheus.io/path"]
    assert path in served and path in OPEN_PATHS, "the scrape path is served without a key"
    (key,) = [e for e in c["env"] if e["name"] == API_KEY_ENV]
    ref = key["valueFrom"]["secretKeyRef"]
    assert ref["optional"] is True, "no Secret: the server runs without a key"


def test_consolidate_job_feeds_the_inference_model(variant):
    _, params, docs = variant
    (c,) = one(docs["consolidate"], "Job")["spec"]["template"]["spec"]["containers"]
    scripts = re.search(r"\[project\.scripts\]\s*\n([^\[]*)", (REPO / "pyproject.toml").read_text())
    assert re.search(r'^neuron-tp\s*=\s*"neuron_tp\.cli:main"', scripts.group(1), re.M)
    assert argv(c)[:2] == ["neuron-tp", "consolidate"] and len(argv(c)) == 4
    ckpt, out = argv(c)[2:]
    assert ckpt == params["OUTPUT_DIR"], "consolidates the newest checkpoint of the run"
    (inf,) = one(docs["inference"], "Deployment")["spec"]["template"]["spec"]["containers"]
    assert f"--model={out}" in inf["args"], "inference serves the consolidated directory"
    res = c["resources"]
    assert res["requests"] == res["limits"]


# ----------------------------------------------------------------------------- image


def _tool(name: str) -> str:
    path = Path(sys.executable).parent / name
    assert path.exists(), f"{name} not installed: pip install -r requirements-dev.txt"
    return str(path)


def test_dockerfile_is_hadolint_clean(tmp_path):
    res = subprocess.run(
        [_tool("hadolint"), "--no-color", str(REPO / "Dockerfile")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert res.returncode == 0 and res.stdout.strip() == "", res.stdout + res.stderr
    bad = tmp_path / "Dockerfile"  # and it does report problems
    bad.write_text("FROM ubuntu:latest\nRUN pip install torch\n")
    res = subprocess.run(
        [_tool("hadolint"), "--no-color", str(bad)], capture_output=True, text=True
    )
    assert res.returncode != 0 and "DL3007" in res.stdout


def test_dockerfile_copies_what_exists_and_keeps_the_neuron_stack():
    text = (REPO / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM\s+(\S+)", text, re.M)
    repo_tag = base.rsplit(":", 1)
    assert len(repo_tag) == 2 and repo_tag[1] != "latest"
    assert repo_tag[0].endswith("/pytorch-training-neuronx")
    torch_pin = re.search(r"^torch==(\d+\.\d+)", (REPO / "requirements-dev.txt").read_text(), re.M)
    assert repo_tag[1].startswith(torch_pin.group(1) + "."), "base image torch != our pin"
    assert re.search(r"^WORKDIR\s+" + re.escape(IMAGE_ROOT) + r"\s*$", text, re.M)
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    copied = []
    for line in re.findall(r"^COPY\s+(.+)$", text, re.M):
        *srcs, _dest = [w for w in line.split() if not w.startswith("--")]
        copied += [s.rstrip("/") for s in srcs]
    assert {"pyproject.toml", "neuron_tp", "scripts"} <= set(copied)
    for src in copied:
        assert (REPO / src).exists(), f"Dockerfile copies {src}, which is not in the repo"
        assert f"!{src}/**" in ignore or (REPO / src).is_file() and f"!{src}" in ignore, src
    readme = re.search(r'^readme\s*=\s*"([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert readme is None or readme.group(1) in copied, "pip install . needs the readme"
    runs = " ".join(re.findall(r"^RUN\s+((?:.*\\\n)*.*)$", text, re.M))
    installs = re.findall(r"pip install ([^&]+)", runs)
    assert any(re.search(r"--no-deps (-e )?\.", i) for i in installs)
    from neuron_tp.cli.args import train_parser  # the default corpus ships in the image

    corpus = Path(train_parser().get_default("data")).resolve().relative_to(REPO)
    assert corpus.parts[0] in copied and any("--no-deps -e ." in i for i in installs)
    for i in installs:
        for pkg in re.findall(r'"?([A-Za-z][\w.-]*)[=<>~!]', i):
            assert not re.match(r"(torch|neuron|libneuronxla|jax)", pkg), f"reinstalls {pkg}"
        assert "-c " in i or "--no-deps" in i, "every install is constrained to the image"
    (user,) = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert user not in ("0", "root")
    for t in ("train", "precompile", "consolidate", "inference"):
        for doc in yaml.safe_load_all(render(t)):
            if doc["kind"] in ("Job", "Deployment", "PyTorchJob"):  # the pods, not a Service
                assert f"runAsUser: {user}" in yaml.safe_dump(doc), "pods run as image user"
    entry = json.loads(re.search(r"^ENTRYPOINT\s+(\[.*\])", text, re.M).group(1))
    assert entry[0] == "torchrun" and (REPO / entry[-1]).is_file()
    assert not re.search(r"(?i)(aws_secret|password|token)\s*=", text)


# ----------------------------------------------------------------------------- security scan


def test_security_scan_reports_nothing_unexplained(tmp_path):
    """checkov over the Dockerfile and every rendered manifest; PyTorchJob pod templates are
    scanned as Pods (checkov does not know the CRD). Skips must carry a written reason."""
    scan = tmp_path / "scan"
    scan.mkdir()
    shutil.copy(REPO / "Dockerfile", scan / "Dockerfile")
    for name, overrides in VARIANTS.items():
        for t in TEMPLATES:
            docs = []
            for doc in yaml.safe_load_all(render(t, *overrides)):
                if doc and doc["kind"] == "PyTorchJob":
                    tmpl = worker_template(doc)
                    doc = {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "spec": tmpl["spec"],
                        "metadata": {
                            **tmpl["metadata"],
                            "name": doc["metadata"]["name"] + "-worker",
                            "namespace": doc["metadata"]["namespace"],
                        },
                    }
                docs.append(doc)
            (scan / f"{name}-{t}.yaml").write_text(yaml.safe_dump_all(docs))
    env = {**os.environ, "CHECKOV_PARALLELIZATION_TYPE": "none", "BC_SKIP_MAPPING": "TRUE"}
    res = subprocess.run(
        [
            _tool("checkov"),
            "-d",
            str(scan),
            "--framework",
            "kubernetes",
            "dockerfile",
            "-o",
            "json",
            "--skip-download",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    reports = json.loads(res.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    assert {r["check_type"] for r in reports} == {"kubernetes", "dockerfile"}, res.stderr[-2000:]
    for r in reports:
        assert r["summary"]["parsing_errors"] == 0 and r["summary"]["passed"] > 10
        failed = [
            (c["check_id"], c["file_path"], c["check_name"]) for c in r["results"]["failed_checks"]
        ]
        assert not failed, failed
        skipped = r["results"]["skipped_checks"]
        assert skipped, "inline skip annotations were not read"
        for c in skipped:
            reason = c.get("suppress_comment") or c["check_result"].get("suppress_comment") or ""
            assert len(reason.split()) >= 5, f"{c['check_id']} skipped without a reason"
