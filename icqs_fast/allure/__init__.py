"""ALLURE: audit and improve an LLM evaluator with iterative in-context learning.

An evaluator labels (task, response) records; its mistakes on a training split become in-context
examples (the restated record answered with its correct label); an audit accepts or rejects each;
accepted ones enter an append-only example memory, which becomes the evaluator's prompt for the
next round. Every reported number is on a held-out split that never enters the memory.

Public API: :func:`audit` (the loop), :class:`LikelihoodEvaluator` / :class:`ICQSEvaluator`,
:class:`Memory`, the audits (:class:`AutoAudit`, :class:`AcceptAll`, :class:`CallableAudit`,
:class:`FileAudit`), the data loaders and the studies (:mod:`icqs_fast.allure.studies`).
"""

from icqs_fast.allure.data import (
    LLMBAR_TASK,
    SUMMEVAL_TASK,
    AuditRecord,
    CustomFields,
    TaskSpec,
    custom_task,
    load_custom,
    load_llmbar,
    load_summeval,
    load_task,
    split,
    spread,
)
from icqs_fast.allure.evaluators import (
    Example,
    ICQSEvaluator,
    Judgment,
    LikelihoodEvaluator,
    make_example,
)
from icqs_fast.allure.loop import (
    AcceptAll,
    AuditResult,
    AutoAudit,
    CallableAudit,
    Candidate,
    FileAudit,
    RoundResult,
    audit,
    score_judgments,
)
from icqs_fast.allure.memory import HeldoutLeakError, Memory, MemoryEntry
from icqs_fast.allure.truth import label_truth, normalise, regex_truth

__all__ = [
    "LLMBAR_TASK", "SUMMEVAL_TASK", "AcceptAll", "AuditRecord", "AuditResult", "AutoAudit",
    "CallableAudit", "Candidate", "CustomFields", "Example", "FileAudit", "HeldoutLeakError",
    "ICQSEvaluator", "Judgment", "LikelihoodEvaluator", "Memory", "MemoryEntry", "RoundResult",
    "TaskSpec", "audit", "custom_task", "label_truth", "load_custom", "load_llmbar",
    "load_summeval", "load_task", "make_example", "normalise", "regex_truth",
    "score_judgments", "split", "spread",
]
