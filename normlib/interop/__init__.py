"""What other libraries' norm classes compute, one small entry each.

:func:`normlib.swap_norms` uses this table to decide, for each module of a
model, whether normlib can run it through its fused kernels *without changing
its numbers*: a norm's result depends not only on its formula but on where it
rounds. Each entry says how a class is recognised and in which order it
rounds (up-cast to float32, where the result is cast back, whether the weight
multiplies before or after that cast):

==============================  =================================================================
kind                            rounding order
==============================  =================================================================
``layer_norm``                  ``torch.nn.LayerNorm``: statistics and ``x̂ ⊙ γ + β`` in float32,
                                one cast to the input's dtype at the end; under autocast x, γ
                                and β are first cast to the dtype autocast runs it in (float32
                                on CUDA, the autocast dtype on CPU). Also timm's
                                ``LayerNorm`` (which calls ``F.layer_norm``) when its fast-norm
                                mode is off, and transformers' ``ConvNextLayerNorm`` with
                                ``data_format="channels_last"``.
``channels_first_layer_norm``   ConvNeXt-style LayerNorm over the channels of ``(N, C, H, W)``
                                input (transformers' ``ConvNextLayerNorm`` with
                                ``data_format="channels_first"`` and its copies, timm's
                                ``LayerNorm2d``, transformers' ``EomtLayerNorm2d``, diffusers'
                                ``SDCascadeLayerNorm``): the channel
                                dimension is moved last, normalized in ``layer_norm``'s order,
                                and moved back, so the output is a permuted view, as theirs.
                                (Each kind's ``layout`` says where it normalizes; the other
                                ``channels_first_*`` kinds below are timm's 2d variants.)
``rms_norm``                    ``torch.nn.RMSNorm``: like ``layer_norm``, without mean and β.
``llama_rms_norm``              Llama, Mistral, Qwen2/3, Mamba and the other classes whose forward
                                is Llama's, Llama-4's text RMSNorm, CPM-Ant's: ``x̂`` in float32 is
                                cast to the input's dtype *before* multiplying by γ; the output
                                has the promoted dtype of γ and x.
``gemma_rms_norm``              Gemma (and diffusers' ``QwenImage21ZeroCenterRMSNorm``):
                                ``x̂ ⊙ (1 + γ)`` all in float32, cast to the input's dtype at
                                the end.
``t5_layer_norm``               T5: RMS statistics in float32; ``x̂`` is cast to γ's dtype when
                                γ is float16/bfloat16, then multiplied by γ; else the output is
                                float32. Also diffusers' ``RMSNorm`` (SD3's and Flux's q/k
                                norms) without β; without γ it is ``float32_rms_norm``'s.
``float32_rms_norm``            OLMo-2/OLMo-3, gpt-oss, Helium, Moshi, Gemma-3n and the RMSNorms
                                without γ (NanoChat, Llama-4's L2 norm, ...), diffusers'
                                ``MochiRMSNorm``, ``Cosmos3NemotronRMSNorm`` and
                                ``StableAudio3RMSNorm``, timm's ``RmsNormFp32``: ``x̂ ⊙ γ`` in
                                float32 (γ up-cast), one cast to the input's dtype at the end.
                                ``channels_first_float32_rms_norm`` (timm's ``RmsNorm2dFp32``):
                                the same over the channels of ``(N, C, H, W)``, the output in the
                                input's memory format, as an elementwise forward returns it.
``input_dtype_rms_norm``        timm's ``RmsNorm`` (fast-norm mode off): torch's ops in the input's
                                dtype, which for float32 input outside autocast is
                                ``float32_rms_norm``'s order; on 16-bit input (statistics in 16
                                bits) or under autocast it runs unchanged.
                                ``channels_first_input_dtype_rms_norm``: timm's ``RmsNorm2d``,
                                the same over the channels, output in the input's memory format.
``float32_layer_norm``          Cohere's LayerNorm (γ, no β) and OLMo's (neither): statistics
                                and ``x̂ ⊙ γ`` in float32, one cast to the input's dtype at the
                                end, with or without autocast.
``upcast_layer_norm``           diffusers' ``FP32LayerNorm``, timm's ``LayerNormFp32``: x, γ and β
                                up-cast to float32 for ``F.layer_norm``, one cast to the input's
                                dtype at the end; where autocast would run ``F.layer_norm`` in a
                                16-bit dtype (a policy asked of torch) it runs unchanged.
                                ``channels_first_upcast_layer_norm``: timm's ``LayerNorm2dFp32``,
                                the same over the channels, moved back as a view.
``layer_norm_1p``               Nemotron's ``LayerNorm1P``: ``1 + γ`` computed (and rounded) in
                                γ's dtype, then ``layer_norm``'s order; under autocast the input,
                                ``1 + γ`` and β are first cast to the autocast dtype, and the norm
                                runs in that dtype.
``deberta_layer_norm``          DeBERTa's (v1) LayerNorm: ``x̂`` in float32, cast to the input's
                                dtype, *then* ``γ ⊙ x̂ + β`` (output: promoted dtype of γ, x, β).
==============================  =================================================================

Recognition is by what a module computes, never by its name: a class counts
when its ``forward`` is the same code as the forward of one of the *anchor*
classes below: the same syntax tree once annotations, docstrings, comments,
formatting and the names of local variables are set aside, the same objects
behind the global names it uses (``torch``, ``F``, ...), the same code behind
every method it calls on ``self``, and the same method behind every
``super().…`` call; and the module holds every attribute that code reads.
``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm`` are anchors too, so their
subclasses count when they keep torch's forward. An anchor from another library
(transformers, diffusers, timm) is read from its source file wherever that
library is installed, without importing it, and imported only once a class's
forward has the anchor's syntax tree: so a model that copies, say, Llama's
RMSNorm into its own code is recognised whether or not transformers was
imported, and normlib itself imports none of these libraries. (A copy is not
recognised where the anchor's library is not installed: then there is nothing
to compare it with.)

Some norms are recognised and deliberately left alone (``UNFUSED``), each
with the reason the report gives: gated RMSNorms, timm's ``SimpleNorm``
(x / std(x), no mean subtracted), frozen batch norms, and torch's
BatchNorm/GroupNorm/InstanceNorm/LocalResponseNorm. Anything else is
left alone and reported too, e.g. VitDet's LayerNorm, whose statistics are
computed in the input's own dtype (the kernels accumulate in float32 and cannot
round like it). The tests ``tests/test_swap_scan.py`` classify every norm
class of the installed ``transformers``, ``diffusers`` and ``timm``.

On tensors the kernels do not cover (CPU, other dtypes, wide rows, a weight
on another device), a swapped module runs its class's own ``forward``: the
same numbers, bit for bit. The function ``fused`` decides that, in one place.
"""

from .kinds import KINDS, UNFUSED, Anchor, Binding, NormKind, Unfused, fused
from .recognition import Verdict, classify, recognise

__all__ = ["Anchor", "Binding", "NormKind", "Unfused", "KINDS", "UNFUSED", "recognise", "classify", "Verdict",
           "fused"]
