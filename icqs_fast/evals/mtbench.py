"""``icqs-fast eval mtbench``: correlation of glass-box features with GPT-4 scores on MT-Bench.

Data (read in place, never copied; by default the registry's ``mtbench`` folder,
:data:`icqs_fast.io.datasets.EVAL_DATASETS`): ``question.jsonl``,
``model_answer_<model>.jsonl`` (answers in ``choices[0].turns``),
``judgment_gpt-4_single.jsonl`` (``question_id``, ``model``, ``turn``, ``score``; judgments with
a score below 1, i.e. GPT-4's ``-1`` = unparsable, are dropped) and, for the reference
augmentations, ``reference_answer_gpt-4.jsonl``.

Each judged (question, turn, model) answer is scored by the evaluator (default: the embedded
SmolLM2-135M-Instruct). Turn 1 is prompted with question 1; turn 2 with question 1 and the model's
own turn-1 answer as an earlier chat turn, then question 2 (the attention features use the
question-2 tokens as "instruction keys"). The answers come from other models (Llama-2-7B-chat and
Vicuna-7B), so with the embedded evaluator this is *cross*-evaluation, not self-evaluation.

The table reports the raw correlation of each feature's value with the GPT-4 score, together
with the feature's direction (``FEATURE_DIRECTION``: +1 if higher = better). A feature works as
intended when ``direction x correlation > 0``.

``--reference illustrate|calibrate`` applies to every feature of answers whose question has a
GPT-4 reference answer, the ensemble features included: with ``calibrate``, ``unt_exp`` and
``unt_var`` become ``value(answer) - factor x value(reference)``, the reference answer scored by
the same 7-prompt ensemble (:func:`icqs_fast.features.ensembles.prompt_ensemble`).
"""

from __future__ import annotations

ENSEMBLE_FEATURES = ("unt_exp", "unt_var")
