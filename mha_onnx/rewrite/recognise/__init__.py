"""Stage 1 (pass ``Recognise``): each attention core of any spelling becomes one internal
Sdpa node. ``core`` (the rules), ``scores`` (the probabilities tail, the score chain),
``keys`` (K's form, grouped K/V), ``factors`` (constant factors on the scores),
``attention_sinks`` (a learned logit per head in the Softmax), ``masks`` and ``meaning``
(a mask's terms and what they mean), proven by evaluation in ``oracle`` with ``slices`` and
``value_masks``. Recognition does not depend on the target beyond what the form policy
answers (sinks and soft-capping have ORT's kernels only)."""
