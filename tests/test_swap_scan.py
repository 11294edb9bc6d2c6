"""Every norm class of the installed transformers is classified: a kind normlib fuses, or left alone with a reason.

The scan imports every ``transformers.models.*.modeling_*`` module and finds
their norm classes (``tests/_transformers_norms.py`` says which classes count).
Each must be recognised by ``normlib.interop.classify`` as one of normlib's
kinds, be one normlib itself knows to leave alone (``interop.UNFUSED``), or be
on the explicit list ``LEFT_ALONE`` with its reason. So a transformers release
that adds a norm fails this test until the norm is classified: an anchor added
to a kind in ``normlib/interop.py``, or an entry in that list.

The scan runs in a child process: importing some 550 modeling files takes half
a minute and a few hundred MB, which the other tests in this worker should not
carry.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

transformers = pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))

_SCAN = textwrap.dedent('''
    import json, sys, warnings
    warnings.simplefilter("ignore")
    sys.path.insert(0, {here!r})
    import transformers
    transformers.logging.set_verbosity_error()
    import _transformers_norms as T
    from normlib import interop
    out = {{}}
    for key, cls in T.norm_classes().items():
        kind, why = interop.classify(cls)
        out[key] = [kind, why, f"{{cls.__module__}}.{{cls.__qualname__}}"]
    with open(sys.argv[1], "w") as f:  # not stdout: some modeling files print when imported
        json.dump(out, f)
''')


@pytest.fixture(scope="module")
def scan(tmp_path_factory):
    out = tmp_path_factory.mktemp("scan") / "classes.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _SCAN.format(here=HERE), str(out)], capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _major() -> int:
    return int(transformers.__version__.split(".")[0])


def test_every_norm_class_is_a_kind_or_left_alone_with_a_reason(scan):
    import _transformers_norms as T
    from normlib import interop

    unfused = {u.reason for u in interop.UNFUSED.values()}
    unclassified = []
    for key, (kind, why, where) in sorted(scan.items()):
        if kind is not None:
            assert kind in interop.KINDS, key
        elif why not in unfused and not T.left_alone(key, _major()):
            unclassified.append(f"{key} ({where}): {why}")
    assert not unclassified, (
        f"{len(unclassified)} norm class(es) of transformers {transformers.__version__} are neither a kind normlib "
        "fuses nor on the list of those it leaves alone (add an anchor in normlib/interop.py, or an entry with "
        "its reason in tests/_transformers_norms.py):\n" + "\n".join(unclassified))


def test_the_list_of_classes_left_alone_is_honest(scan):
    """A listed class that normlib now fuses must leave the list; every listed reason says something."""
    import _transformers_norms as T

    recognised = [k for k, (kind, _, _) in scan.items() if kind is not None and T.left_alone(k, _major())]
    assert not recognised, f"listed as left alone, but recognised: {recognised}"
    assert all(isinstance(why, str) and len(why) > 20 for why in T.LEFT_ALONE.values())


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
