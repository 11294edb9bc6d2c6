"""Every norm class of the installed transformers, diffusers and timm is classified: a kind, or left alone with a reason.

The scans import every modeling module of each library (transformers'
``transformers.models.*.modeling_*``, every module under ``diffusers.models``,
timm's ``timm.layers.*``; a library not installed, or timm where its
torchvision does not load, is skipped: the torch matrix installs timm beside
its lowest torch, so CI scans it there)
and find their norm classes (``tests/_library_norms.py`` says which classes
count). Each must be recognised by ``normlib.interop.classify`` as one of
normlib's kinds, be one normlib itself knows to leave alone
(``interop.UNFUSED``), or be on the explicit list ``LEFT_ALONE[library]`` with
its reason. So a release that adds a norm fails this test until the norm is
classified: an anchor added to a kind in ``normlib/interop/kinds.py``, or an entry in
that list.

Each scan runs in a child process: importing some 550 modeling files takes half
a minute and a few hundred MB, which the other tests in this worker should not
carry.
"""

import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

LIBRARIES = ("transformers", "diffusers", "timm")
HERE = os.path.dirname(os.path.abspath(__file__))

_SCAN = textwrap.dedent('''
    import json, sys, warnings
    warnings.simplefilter("ignore")
    sys.path.insert(0, {here!r})
    if {library!r} != "timm":
        import transformers
        transformers.logging.set_verbosity_error()
    import _library_norms as T
    from normlib import interop
    out = {{}}
    for key, cls in T.norm_classes({library!r}).items():
        kind, why = interop.classify(cls)
        out[key] = [kind, why, f"{{cls.__module__}}.{{cls.__qualname__}}"]
    with open(sys.argv[1], "w") as f:  # not stdout: some modeling files print when imported
        json.dump(out, f)
''')


def _scan(library, tmp_path_factory):
    if library == "timm":
        pytest.importorskip("timm.layers", reason="timm is not installed, or its torchvision does not load here",
                            exc_type=ImportError)
    else:
        pytest.importorskip("transformers")
        pytest.importorskip(library)
    out = tmp_path_factory.mktemp("scan") / f"{library}.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _SCAN.format(here=HERE, library=library), str(out)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def scans(tmp_path_factory):
    return {}, tmp_path_factory


@pytest.fixture
def scan_of(scans):
    found, factory = scans

    def get(library):
        if library not in found:
            found[library] = _scan(library, factory)
        return found[library]
    return get


@pytest.fixture
def scan(scan_of):
    return scan_of("transformers")


def _major(library="transformers") -> int:
    return int(importlib.import_module(library).__version__.split(".")[0])


@pytest.mark.parametrize("library", LIBRARIES)
def test_every_norm_class_is_a_kind_or_left_alone_with_a_reason(scan_of, library):
    import _library_norms as T
    from normlib import interop

    scan = scan_of(library)
    unfused = {u.reason for u in interop.UNFUSED.values()}
    unclassified = []
    for key, (kind, why, where) in sorted(scan.items()):
        if kind is not None:
            assert kind in interop.KINDS, key
        elif why not in unfused and not T.left_alone(key, _major(library), library):
            unclassified.append(f"{key} ({where}): {why}")
    assert not unclassified, (
        f"{len(unclassified)} norm class(es) of {library} {importlib.import_module(library).__version__} are neither "
        "a kind normlib fuses nor on the list of those it leaves alone (add an anchor in normlib/interop/kinds.py, or an "
        f"entry with its reason in tests/_library_norms.py):\n" + "\n".join(unclassified))


@pytest.mark.parametrize("library", LIBRARIES)
def test_the_list_of_classes_left_alone_is_honest(scan_of, library):
    """A listed class that normlib now fuses must leave the list; every listed reason says something."""
    import _library_norms as T

    scan = scan_of(library)
    major = _major(library)
    recognised = [k for k, (kind, _, _) in scan.items() if kind is not None and T.left_alone(k, major, library)]
    assert not recognised, f"listed as left alone, but recognised: {recognised}"
    assert all(isinstance(why, str) and len(why) > 20 for why in T.LEFT_ALONE[library].values())
    if library != "transformers":  # one release line: every entry names a class the scan found
        assert set(T.LEFT_ALONE[library]) <= set(scan), set(T.LEFT_ALONE[library]) - set(scan)


# library -> the classes the issue names and their kinds, and one class whose reason is checked word for word
NAMED = {
    # SD3's and Flux's q/k norms (diffusers' RMSNorm) and FP32LayerNorm
    "diffusers": ({
        "normalization.RMSNorm": "t5_layer_norm",
        "normalization.FP32LayerNorm": "upcast_layer_norm",
        "normalization.MochiRMSNorm": "float32_rms_norm",
        "unets.unet_stable_cascade.SDCascadeLayerNorm": "channels_first_layer_norm",
    }, "normalization.RMSNorm", "forward identical to diffusers.models.normalization.RMSNorm"),
    # timm's RmsNorm (a ViT with norm_layer="rmsnorm"), RmsNorm2d and their Fp32 variants
    "timm": ({
        "norm.LayerNorm": "layer_norm",
        "norm.LayerNorm2d": "channels_first_layer_norm",
        "norm.LayerNormFp32": "upcast_layer_norm",
        "norm.LayerNorm2dFp32": "channels_first_upcast_layer_norm",
        "norm.RmsNorm": "input_dtype_rms_norm",
        "norm.RmsNorm2d": "channels_first_input_dtype_rms_norm",
        "norm.RmsNormFp32": "float32_rms_norm",
        "norm.RmsNorm2dFp32": "channels_first_float32_rms_norm",
    }, "norm.RmsNorm", "forward identical to timm.layers.norm.RmsNorm"),
}


@pytest.mark.parametrize("library", list(NAMED))
def test_the_norms_the_issue_names_are_recognised_with_true_reasons(scan_of, library):
    scan = scan_of(library)
    expected, key, reason = NAMED[library]
    assert {k: scan[k][0] for k in expected} == expected
    assert scan[key][1] == reason
    if library == "timm":  # SimpleNorm is left alone with what it computes
        for name in ("SimpleNorm", "SimpleNorm2d", "SimpleNormFp32", "SimpleNorm2dFp32"):
            assert scan[f"norm.{name}"][0] is None and "Bessel's correction" in scan[f"norm.{name}"][1], name


def test_the_scan_finds_the_norms_the_issue_names(scan):
    """The classes the issue lists (where this transformers version has them) land in their kinds."""
    expected = {
        "llama.LlamaRMSNorm": "llama_rms_norm",
        "mamba.MambaRMSNorm": "llama_rms_norm",  # Llama's forward with annotations
        "mamba2.Mamba2RMSNorm": "llama_rms_norm",
        "llama4.Llama4TextRMSNorm": "llama_rms_norm",
        "olmo2.Olmo2RMSNorm": "float32_rms_norm",
        "olmo3.Olmo3RMSNorm": "float32_rms_norm",
        "gpt_oss.GptOssRMSNorm": "float32_rms_norm",
        "helium.HeliumRMSNorm": "float32_rms_norm",
        "gemma3n.Gemma3nRMSNorm": "float32_rms_norm",
        "cohere.CohereLayerNorm": "float32_layer_norm",
        "olmo.OlmoLayerNorm": "float32_layer_norm",
        "nemotron.NemotronLayerNorm1P": "layer_norm_1p",
        "deberta.DebertaLayerNorm": "deberta_layer_norm",
        "gemma.GemmaRMSNorm": "gemma_rms_norm",
        "t5.T5LayerNorm": "t5_layer_norm",
        "convnext.ConvNextLayerNorm": "channels_first_layer_norm",
    }
    got = {k: scan[k][0] for k in expected if k in scan}
    assert got == {k: v for k, v in expected.items() if k in scan}
    assert {"llama.LlamaRMSNorm", "cohere.CohereLayerNorm", "nemotron.NemotronLayerNorm1P"} <= set(got)
    for gated in ("mamba2.MambaRMSNormGated", "qwen3_next.Qwen3NextRMSNormGated", "falcon_h1.FalconH1RMSNormGated",
                  "zamba2.Zamba2RMSNormGated"):
        if gated in scan:
            assert scan[gated][0] is None and "gated" in scan[gated][1], gated
    # containers are not norm classes: their norms are
    assert "stablelm.StableLmLayerNormPerHead" not in scan
    assert not any(k.endswith("EncoderStableLayerNorm") for k in scan)
