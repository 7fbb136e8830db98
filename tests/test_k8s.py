"""The Kubernetes manifests (k8s/), the Dockerfile and the configs they name, checked statically.

No cluster is needed: core objects validate against the Kubernetes OpenAPI schemas shipped in
`kubernetes-validate` (strict: unknown fields are errors), Ray objects against the
openAPIV3Schema of KubeRay's CRDs (made strict the same way; the CRD copies live in
../shared/kuberay-crds or $KUBERAY_CRDS_DIR, and those tests skip where they are absent), and
the rest are structure checks: what the entrypoints run exists and validates, GPUs are whole
and not overcommitted, /dev/shm is sized, auth is on, images are pinned, no secret is inline,
the nightly schedule cannot overlap, and the three copies of the Ray cluster agree.
"""

from __future__ import annotations

import copy
import datetime as dt
import os
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pipeline.nightly import load_night
from pipeline.nightly_submit import render_rayjob
from pipeline.settings.config import load_config
from tests.test_layering import installed_packages

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "k8s"
K8S_VERSIONS = ("1.30.0", "1.35.0")  # the oldest Kubernetes we claim, and a recent one
PROJECT_IMAGE = "ghcr.io/your-org/dart-batch"
IMAGE_WORKDIR = "/home/ray/dart-batch"  # the Dockerfile's WORKDIR, which holds configs/
SECRET_NAMES = {"dart-batch-s3", "dart-batch-ray-auth"}
DAY_S = 24 * 3600
FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


MANIFEST_FILES = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
DOCS = [(path.name, doc) for path in MANIFEST_FILES for doc in load_docs(path)]


def only(kind: str, file: str | None = None) -> dict[str, Any]:
    found = [d for name, d in DOCS if d["kind"] == kind and (file is None or name == file)]
    assert len(found) == 1, f"expected one {kind} in {file or 'k8s/'}, found {len(found)}"
    return found[0]


RAYJOB = only("RayJob", "rayjob.yaml")
RAYCRONJOB = only("RayCronJob", "raycronjob.yaml")
RAYCLUSTER = only("RayCluster", "raycluster.yaml")
CRONJOB = only("CronJob", "cronjob.yaml")
# (label, RayJob spec) of every RayJob that can run: the one-off job and the nightly template.
RAYJOB_SPECS = [("rayjob.yaml", RAYJOB["spec"]), ("raycronjob.yaml", RAYCRONJOB["spec"]["jobTemplate"])]
CLUSTER_SPECS = [(n, s["rayClusterSpec"]) for n, s in RAYJOB_SPECS] + [("raycluster.yaml", RAYCLUSTER["spec"])]


def ray_pod_templates(cluster: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [("head", cluster["headGroupSpec"]["template"])] + [
        (g["groupName"], g["template"]) for g in cluster.get("workerGroupSpecs", [])]


def all_pod_specs() -> list[tuple[str, dict[str, Any]]]:
    specs = [(f"{n}:{group}", t["spec"]) for n, c in CLUSTER_SPECS for group, t in ray_pod_templates(c)]
    specs += [(f"{n}:submitter", s["submitterPodTemplate"]["spec"]) for n, s in RAYJOB_SPECS]
    specs.append(("cronjob.yaml", CRONJOB["spec"]["jobTemplate"]["spec"]["template"]["spec"]))
    return specs


def containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return pod_spec.get("containers", []) + pod_spec.get("initContainers", [])


# ---------------------------------------------------------------------------------- parsing


def test_every_manifest_parses_into_named_objects():
    assert {p.name for p in MANIFEST_FILES} >= {"rayjob.yaml", "raycluster.yaml", "raycronjob.yaml", "cronjob.yaml",
                                                "secrets.example.yaml"}
    for path in [*MANIFEST_FILES, K8S / "kustomization.yaml"]:
        docs = load_docs(path)
        assert docs, f"{path.name} is empty"
        for doc in docs:
            assert isinstance(doc, dict) and doc.get("apiVersion") and doc.get("kind"), path.name
            if doc["kind"] != "Kustomization":
                assert doc["metadata"]["name"], path.name


# ------------------------------------------------------------------ core Kubernetes schemas


CORE = [(name, d) for name, d in DOCS if not d["apiVersion"].startswith("ray.io/")]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(("file", "doc"), CORE, ids=[f"{n}:{d['kind']}" for n, d in CORE])
def test_core_objects_validate_against_kubernetes_schemas(file, doc, version):
    kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_pod_templates_inside_ray_objects_validate_against_kubernetes_schemas(version):
    # The CRDs embed the pod schema; the Kubernetes one is stricter (quantities, enums, ...).
    templates = [(f"{n}:{g}", t) for n, c in CLUSTER_SPECS for g, t in ray_pod_templates(c)]
    templates += [(f"{n}:submitter", s["submitterPodTemplate"]) for n, s in RAYJOB_SPECS]
    for label, template in templates:
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"},
                        "template": template}
        try:
            kubernetes_validate.validate(pod_template, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{label}: {exc.message}")


def test_kubernetes_validation_catches_a_broken_object():
    misspelt = copy.deepcopy(CRONJOB)
    misspelt["spec"]["concurencyPolicy"] = misspelt["spec"].pop("concurrencyPolicy")
    mistyped = copy.deepcopy(CRONJOB)
    mistyped["spec"]["jobTemplate"]["spec"]["backoffLimit"] = "none"
    for broken in (misspelt, mistyped):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


# ---------------------------------------------------------------------- KubeRay CRD schemas


def crd_dir() -> Path | None:
    for candidate in (os.environ.get("KUBERAY_CRDS_DIR"), REPO.parent / "shared" / "kuberay-crds"):
        if candidate and (Path(candidate) / "ray.io_rayjobs.yaml").is_file():
            return Path(candidate)
    return None


def strict(schema: Any) -> Any:
    """An OpenAPI schema in which objects with listed properties reject unlisted ones: the API
    server would silently prune an unknown (misspelt) field, which hides the mistake."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def crd_validators() -> dict[str, jsonschema.Validator]:
    directory = crd_dir()
    if directory is None:
        pytest.skip("KubeRay CRDs not found (../shared/kuberay-crds or $KUBERAY_CRDS_DIR): CRD schema checks skipped")
    validators = {}
    for path in directory.glob("ray.io_*.yaml"):
        crd = yaml.load(path.read_text(), Loader=FAST_LOADER)  # 56k lines: the C parser takes a second
        for version in crd["spec"]["versions"]:
            schema = strict(version["schema"]["openAPIV3Schema"])
            validators[f"{crd['spec']['group']}/{version['name']}/{crd['spec']['names']['kind']}"] = \
                jsonschema.Draft7Validator(schema)
    return validators


def crd_errors(validators: dict[str, jsonschema.Validator], doc: dict[str, Any]) -> list[str]:
    key = f"{doc['apiVersion']}/{doc['kind']}"
    assert key in validators, f"no CRD schema for {key}"
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validators[key].iter_errors(doc)]


RAY_DOCS = [(name, d) for name, d in DOCS if d["apiVersion"].startswith("ray.io/")]


@pytest.mark.parametrize(("file", "doc"), RAY_DOCS, ids=[f"{n}:{d['kind']}" for n, d in RAY_DOCS])
def test_ray_objects_validate_against_kuberay_crds(crd_validators, file, doc):
    assert crd_errors(crd_validators, doc) == []


def test_crd_validation_catches_misspelt_and_mistyped_fields(crd_validators):
    typo = copy.deepcopy(RAYJOB)
    typo["spec"]["shutdownAfterJobFinish"] = True
    assert any("shutdownAfterJobFinish" in e for e in crd_errors(crd_validators, typo))
    wrong = copy.deepcopy(RAYJOB)
    wrong["spec"]["rayClusterSpec"]["authOptions"]["mode"] = "password"
    assert crd_errors(crd_validators, wrong)


def test_nightly_rayjob_rendered_from_the_template_validates(crd_validators):
    args = cronjob_args()
    job = render_rayjob(RAYJOB, prefix=args["--name"], day=dt.date(2026, 11, 21), attempt=3,
                        config=args["--config"], active_deadline_s=int(args["--active-deadline-seconds"]))
    assert crd_errors(crd_validators, job) == []
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"]) and len(job["metadata"]["name"]) <= 47


def test_object_names_fit_kuberay_limits():
    # KubeRay derives cluster names from these (+6 characters) and caps them at 53.
    for doc in (RAYJOB, RAYCRONJOB, RAYCLUSTER):
        name = doc["metadata"]["name"]
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 40, name


# ---------------------------------------------------------------------- what the jobs run


def image_path_to_repo(path: str) -> Path:
    assert path.startswith(IMAGE_WORKDIR + "/"), f"{path} is not under the image's {IMAGE_WORKDIR}"
    return REPO / path.removeprefix(IMAGE_WORKDIR + "/")


def module_file(module: str) -> Path:
    return REPO / (module.replace(".", "/") + ".py")


def test_rayjob_entrypoint_runs_the_pipeline_on_a_valid_config_in_the_image():
    argv = shlex.split(RAYJOB["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "pipeline.run"] and module_file(argv[2]).is_file()
    config = image_path_to_repo(argv[3])
    assert config.is_file(), config
    cfg = load_config(config, argv[4:])
    assert cfg.resources.num_gpus_per_worker >= 1
    assert all(u.startswith("s3://") for u in cfg.input.urls) and cfg.output.url.startswith("s3://")
    assert cfg.run.run_id and cfg.run.resume  # a RayJob retry (backoffLimit) resumes


def test_raycronjob_entrypoint_runs_the_nightly_job_on_a_valid_config():
    argv = shlex.split(RAYCRONJOB["spec"]["jobTemplate"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "jobs.nightly"] and module_file(argv[2]).is_file()
    night = load_night(image_path_to_repo(argv[3]), [*argv[4:], "date=2026-11-21"])
    assert night.config.output.url.endswith("2026-11-21") and night.config.run.resume


def cronjob_container() -> dict[str, Any]:
    (container,) = CRONJOB["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    return container


def cronjob_args() -> dict[str, str]:
    args = cronjob_container()["args"]
    return {"template": args[0], **dict(a.split("=", 1) for a in args[1:])}


def test_cronjob_runs_the_submitter_on_the_generated_template():
    container = cronjob_container()
    assert container["command"] == ["python", "-m", "jobs.nightly_submit"]
    assert module_file("jobs.nightly_submit").is_file()
    args = cronjob_args()
    load_night(image_path_to_repo(args["--config"]), ["date=2026-11-21"])
    # The template is rayjob.yaml, through the ConfigMap that kustomization.yaml generates.
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    (generator,) = kustomization["configMapGenerator"]
    assert generator["files"] == ["rayjob.yaml"]
    pod = CRONJOB["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mount = next(m for m in container["volumeMounts"] if args["template"].startswith(m["mountPath"] + "/"))
    assert volumes[mount["name"]]["configMap"]["name"] == generator["name"]
    assert args["template"] == f"{mount['mountPath']}/rayjob.yaml"
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file()


# ------------------------------------------------------------------------------ the clusters


def test_the_three_ray_clusters_are_the_same_cluster():
    reference = RAYJOB["spec"]["rayClusterSpec"]
    assert RAYCRONJOB["spec"]["jobTemplate"]["rayClusterSpec"] == reference
    assert RAYCRONJOB["spec"]["jobTemplate"]["submitterPodTemplate"] == RAYJOB["spec"]["submitterPodTemplate"]
    standalone = copy.deepcopy(RAYCLUSTER["spec"])
    for group, ref_group in zip(standalone["workerGroupSpecs"], reference["workerGroupSpecs"], strict=True):
        assert group["minReplicas"] == 0  # the long-lived cluster releases its GPUs when idle
        group["replicas"], group["minReplicas"] = ref_group["replicas"], ref_group["minReplicas"]
    assert standalone == reference


@pytest.mark.parametrize(("file", "spec"), RAYJOB_SPECS, ids=[n for n, _ in RAYJOB_SPECS])
def test_rayjob_lifecycle(file, spec):
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["ttlSecondsAfterFinished"] > 0
    assert spec["activeDeadlineSeconds"] > 0
    assert spec.get("submissionMode", "K8sJobMode") == "K8sJobMode"
    submitter = spec["submitterPodTemplate"]["spec"]
    assert submitter["restartPolicy"] == "Never" and submitter["containers"]


@pytest.mark.parametrize(("file", "cluster"), CLUSTER_SPECS, ids=[n for n, _ in CLUSTER_SPECS])
def test_cpu_head_and_gpu_workers(file, cluster):
    head = cluster["headGroupSpec"]["template"]["spec"]
    for c in containers(head):
        resources = c.get("resources", {})
        assert "nvidia.com/gpu" not in {**resources.get("requests", {}), **resources.get("limits", {})}
    gpu_groups = [g for g in cluster["workerGroupSpecs"]
                  if any("nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
                         for c in containers(g["template"]["spec"]))]
    assert gpu_groups, "no worker group asks for GPUs"
    for g in gpu_groups:
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]


def test_gpu_requests_equal_limits_everywhere():
    for label, pod in all_pod_specs():
        for c in containers(pod):
            requests = c.get("resources", {}).get("requests", {})
            limits = c.get("resources", {}).get("limits", {})
            for key in ("nvidia.com/gpu", "amd.com/gpu"):
                if key in requests or key in limits:
                    assert str(requests.get(key)) == str(limits.get(key)), f"{label}/{c['name']}: {key}"
                    assert int(limits[key]) >= 1


def quantity_bytes(text: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "": 1}
    number, unit = re.fullmatch(r"(\d+)([KMGT]i?|)", str(text)).groups()
    return int(number) * units[unit]


@pytest.mark.parametrize(("file", "cluster"), CLUSTER_SPECS, ids=[n for n, _ in CLUSTER_SPECS])
def test_dev_shm_is_memory_backed_sized_and_holds_the_object_store(file, cluster):
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group, (name, template) in zip(groups, ray_pod_templates(cluster), strict=True):
        pod = template["spec"]
        shm_volumes = {v["name"]: v for v in pod.get("volumes", [])
                       if v.get("emptyDir", {}).get("medium") == "Memory"}
        ray_container = pod["containers"][0]
        mounts = [m for m in ray_container.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
        assert len(mounts) == 1 and mounts[0]["name"] in shm_volumes, f"{name}: no memory-backed /dev/shm"
        size = quantity_bytes(shm_volumes[mounts[0]["name"]]["emptyDir"]["sizeLimit"])
        object_store = int(group["rayStartParams"]["object-store-memory"])
        assert object_store < size, f"{name}: the object store does not fit /dev/shm"
        # A memory-backed volume is charged to the container's memory.
        assert size < quantity_bytes(ray_container["resources"]["limits"]["memory"])


def test_config_fits_the_gpu_worker_group():
    cfg = load_config(image_path_to_repo(shlex.split(RAYJOB["spec"]["entrypoint"])[3]))
    night = load_night(image_path_to_repo(shlex.split(RAYCRONJOB["spec"]["jobTemplate"]["entrypoint"])[3]),
                       ["date=2026-11-21"])
    (group,) = RAYJOB["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    for c in (cfg, night.config):
        r = c.resources
        assert (r.max_workers or r.num_workers) * r.num_gpus_per_worker <= group["maxReplicas"] * int(
            limits["nvidia.com/gpu"])
        assert r.num_cpus_per_worker * (1 / r.num_gpus_per_worker) * int(limits["nvidia.com/gpu"]) <= int(
            limits["cpu"])


@pytest.mark.parametrize(("file", "cluster"), CLUSTER_SPECS, ids=[n for n, _ in CLUSTER_SPECS])
def test_ray_token_auth_is_on_and_the_ray_version_matches_the_image(file, cluster):
    auth = cluster["authOptions"]
    assert auth["mode"] == "token" and auth["secretName"] in SECRET_NAMES
    assert not auth.get("enableK8sTokenAuth")  # KubeRay rejects it for RayJobs
    version = tuple(int(x) for x in cluster["rayVersion"].split("."))
    assert version >= (2, 52, 0)  # KubeRay's minimum for token auth
    assert cluster["rayVersion"] == dockerfile_args()["RAY_VERSION"]


@pytest.mark.parametrize(("file", "cluster"), CLUSTER_SPECS, ids=[n for n, _ in CLUSTER_SPECS])
def test_ray_pods_get_object_store_credentials_from_a_secret(file, cluster):
    for name, template in ray_pod_templates(cluster):
        c = template["spec"]["containers"][0]
        refs = [e["secretRef"]["name"] for e in c.get("envFrom", []) if "secretRef" in e]
        assert "dart-batch-s3" in refs, f"{name}: no envFrom secretRef dart-batch-s3"


# ------------------------------------------------------------------------------- the schedule


def test_raycronjob_runs_daily_in_utc_and_cannot_overlap():
    spec = RAYCRONJOB["spec"]
    assert spec["schedule"].split()[2:] == ["*", "*", "*"], "the bound below assumes a daily schedule"
    assert spec["timeZone"] == "Etc/UTC"  # jobs.nightly's default date is the UTC date
    job = spec["jobTemplate"]
    # No concurrencyPolicy in this CRD: a run ends (deadline, then TTL) before the next tick.
    assert job["activeDeadlineSeconds"] + job["ttlSecondsAfterFinished"] < DAY_S
    # The entrypoint takes its date from the clock: a KubeRay retry after midnight UTC would
    # run the next night, so there is none.
    assert "date=" not in job["entrypoint"] and job.get("backoffLimit", 0) == 0


def test_cronjob_forbids_overlap_and_outlives_its_rayjob():
    spec = CRONJOB["spec"]
    assert spec["concurrencyPolicy"] == "Forbid"
    assert spec["timeZone"] == "Etc/UTC" and spec["schedule"] == RAYCRONJOB["spec"]["schedule"]
    job = spec["jobTemplate"]["spec"]
    rayjob_end = int(cronjob_args()["--active-deadline-seconds"]) + RAYJOB["spec"]["ttlSecondsAfterFinished"]
    assert rayjob_end <= job["activeDeadlineSeconds"] < DAY_S


def test_cronjob_rbac_is_least_privilege():
    pod = CRONJOB["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    account = only("ServiceAccount", "cronjob.yaml")
    role, binding = only("Role", "cronjob.yaml"), only("RoleBinding", "cronjob.yaml")
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": kustomization["namespace"]}]
    assert not any(d["kind"] in ("ClusterRole", "ClusterRoleBinding") for _, d in DOCS)
    for rule in role["rules"]:
        assert rule["apiGroups"] == ["ray.io"] and rule["resources"] == ["rayjobs"]
        assert set(rule["verbs"]) <= {"create", "get", "list"} and "*" not in rule["verbs"]


# ------------------------------------------------------------------------ images and secrets


def all_images() -> list[tuple[str, str]]:
    images = []
    for label, pod in all_pod_specs():
        images += [(f"{label}/{c['name']}", c["image"]) for c in containers(pod)]
    for _, cluster in CLUSTER_SPECS:
        if cluster.get("autoscalerOptions", {}).get("image"):
            images.append(("autoscaler", cluster["autoscalerOptions"]["image"]))
    return images


def is_pinned(image: str) -> bool:
    if "@sha256:" in image:
        return True
    last = image.rsplit("/", 1)[-1]
    return ":" in last and last.rsplit(":", 1)[1] not in ("", "latest")


def test_every_image_is_pinned_and_is_the_project_image():
    images = all_images()
    assert len(images) >= 9  # 3 clusters x (head, GPU workers) + 2 submitters + the CronJob
    for where, image in images:
        assert is_pinned(image), f"{where}: image {image!r} has no tag or digest, or is :latest"
        assert image.split("@")[0].rsplit(":", 1)[0] == PROJECT_IMAGE, f"{where}: {image}"
    assert len({image for _, image in images}) == 1, "head, workers and submitters must run one image"
    assert not is_pinned("rayproject/ray") and not is_pinned("ray:latest") and not is_pinned("host:5000/ray")


CREDENTIAL_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL", re.IGNORECASE)
CREDENTIAL_TEXT = [
    re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),  # AWS access key ids
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"\b[0-9a-f]{32,}\b"),  # hex tokens (a Ray token from `openssl rand -hex 32`)
    re.compile(r"\b[A-Za-z0-9+/]{40}\b"),  # AWS secret access keys
]

# A key's value written out (anything but the REPLACE_ME placeholder).
INLINE_KEY = re.compile(r"(?im)^\s*(aws_)?(secret_)?access_key(_id)?\s*[:=]\s*[\"']?(?!REPLACE_ME\b)\w")


def test_no_secret_values_in_any_manifest():
    for file, doc in DOCS:
        if doc["kind"] == "Secret":
            assert doc["metadata"]["name"] in SECRET_NAMES
            assert "data" not in doc, f"{file}: Secret {doc['metadata']['name']} carries data"
            assert set(doc["stringData"].values()) == {"REPLACE_ME"}, f"{file}: a Secret holds a real value"
    for label, pod in all_pod_specs():
        for c in containers(pod):
            for env in c.get("env", []):
                if CREDENTIAL_NAME.search(env["name"]):
                    assert "value" not in env and "secretKeyRef" in env.get("valueFrom", {}), \
                        f"{label}/{c['name']}: {env['name']} must come from a Secret"
            for source in c.get("envFrom", []):
                assert "secretRef" in source or "configMapRef" in source
    for path in [*MANIFEST_FILES, K8S / "kustomization.yaml", REPO / "Dockerfile",
                 REPO / "configs" / "cluster.yaml", REPO / "configs" / "nightly.yaml"]:
        text = path.read_text()
        for pattern in CREDENTIAL_TEXT:
            assert not pattern.search(text), f"{path.name}: looks like a credential: {pattern.pattern}"
        leaked = INLINE_KEY.search(text)
        assert not leaked, f"{path.name}: {leaked.group(0) if leaked else ''}"


def test_secret_detection_would_notice_a_leak():
    assert any(p.search("AWS_ACCESS_KEY_ID: AKIAIOSFODNN7EXAMPLE") for p in CREDENTIAL_TEXT)
    assert any(p.search("auth_token: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08")
               for p in CREDENTIAL_TEXT)
    assert INLINE_KEY.search("env:\n  AWS_SECRET_ACCESS_KEY: 'wJalrXUtnFEMI'\n")
    assert not INLINE_KEY.search("stringData:\n  AWS_SECRET_ACCESS_KEY: REPLACE_ME\n")


# ------------------------------------------------------------------------------- Dockerfile


def dockerfile_lines() -> list[str]:
    """Instructions with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def dockerfile_args() -> dict[str, str]:
    args = {}
    for line in dockerfile_lines():
        match = re.fullmatch(r"ARG (\w+)=(\S+)", line)
        if match:
            args[match.group(1)] = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], match.group(2))
    return args


def test_dockerfile_base_image_is_pinned_and_matches_ray():
    args = dockerfile_args()
    base = args["BASE_IMAGE"]
    assert is_pinned(base), base
    assert base.startswith("rayproject/ray:") and f":{args['RAY_VERSION']}-py311-" in base
    froms = [line.split()[1] for line in dockerfile_lines() if line.startswith("FROM ")]
    assert froms and all(f == "${BASE_IMAGE}" for f in froms), froms
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])


def test_dockerfile_builds_the_extension_and_installs_the_project():
    lines = dockerfile_lines()
    text = "\n".join(lines)
    assert re.search(r"apt-get install .*\bg\+\+", text), "the build stage needs a C++ compiler"
    assert re.search(r"pip wheel .* \.$", text, re.MULTILINE), "the project (and its extension) is built"
    install = next(line for line in lines if "pip install" in line and "[default]" in line)
    assert "ray[default,data,train]==${RAY_VERSION}" in install and "torch==${TORCH_VERSION}" in install
    assert "import torch, ngram_native._core" in text, "the image build imports the compiled extension"
    for package in installed_packages():
        assert any(line.startswith(f"COPY {package}/") for line in lines), package


def test_dockerfile_runs_as_non_root_and_ships_the_configs_where_manifests_look():
    lines = dockerfile_lines()
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users[-1] not in ("root", "0") and not users[-1].startswith(("root:", "0:"))
    uid = users[-1].split(":")[0]
    for label, pod in all_pod_specs():
        context = pod.get("securityContext", {})
        assert context.get("runAsNonRoot") is True and str(context.get("runAsUser")) == uid, label
    assert [line.split()[1] for line in lines if line.startswith("WORKDIR ")][-1] == IMAGE_WORKDIR
    assert any(re.fullmatch(r"COPY (--chown=\S+ )?configs/ configs/", line) for line in lines)


def test_dockerignore_keeps_local_build_products_out():
    ignore = (REPO / ".dockerignore").read_text().split()
    assert ignore[ignore.index("*") if "*" in ignore else 0] == "*"
    for pattern in ("**/*.so", "**/__pycache__"):
        assert pattern in ignore
    for needed in (*(f"!{package}/" for package in installed_packages()), "!configs/", "!pyproject.toml",
                   "!setup.py", "!README.md"):
        assert needed in ignore


# ----------------------------------------------------------------------------------- metrics

METRICS_PORT = 8080


@pytest.mark.parametrize(("file", "cluster"), CLUSTER_SPECS, ids=[n for n, _ in CLUSTER_SPECS])
def test_every_ray_pod_exports_metrics_on_a_named_port(file, cluster):
    groups = [("head", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster.get("workerGroupSpecs", [])]
    for name, group in groups:
        assert group["rayStartParams"].get("metrics-export-port") == str(METRICS_PORT), f"{file}:{name}"
        ports = group["template"]["spec"]["containers"][0].get("ports", [])
        assert {"containerPort": METRICS_PORT, "name": "metrics"} in ports, f"{file}:{name}"


def test_podmonitor_scrapes_every_ray_pod_on_the_metrics_port():
    (monitor,) = load_docs(K8S / "monitoring" / "podmonitor.yaml")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    spec = monitor["spec"]
    assert spec["namespaceSelector"]["matchNames"] == [monitor["metadata"]["namespace"]] == ["dart-batch"]
    assert [e["port"] for e in spec["podMetricsEndpoints"]] == ["metrics"]
    assert set(spec) <= {"namespaceSelector", "selector", "podMetricsEndpoints", "jobLabel", "podTargetLabels"}

    def selected(labels: dict[str, str]) -> bool:
        sel = spec["selector"]
        return (all(labels.get(k) == v for k, v in sel.get("matchLabels", {}).items())
                and all(labels.get(e["key"]) in e["values"] for e in sel.get("matchExpressions", [])
                        if e["operator"] == "In"))

    for file, cluster in CLUSTER_SPECS:
        for group, template in ray_pod_templates(cluster):
            assert selected(template["metadata"]["labels"]), f"{file}:{group} is not scraped"
    for file, spec_ in RAYJOB_SPECS:  # the submitter has no metrics port: not selected
        assert not selected(spec_["submitterPodTemplate"].get("metadata", {}).get("labels", {})), file


def test_grafana_dashboard_queries_only_exported_metrics_and_shows_all_of_them():
    import json

    from pipeline.cluster.metrics import METRICS, exported_names

    dashboard = json.loads((K8S / "grafana" / "dart-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    used = {name for e in exprs for name in re.findall(r"\bray_dart_\w+", e)}
    assert used <= exported_names(), used - exported_names()
    for name in METRICS:
        assert any(u.startswith(f"ray_dart_{name}_") or u == f"ray_dart_{name}" for u in used), name
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"]
