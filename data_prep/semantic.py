"""Semantic dedup: documents that say the same thing in other words (NeMo Curator's SemDedup).

MinHash and paragraph dedup see shared *text*: a paraphrase (sentences reordered, words swapped for
synonyms, names changed) shares few word 5-grams with its source (Jaccard under 0.25 on the planted
set of `tests/paraphrases.py`) and passes both. This finds it by embeddings:

1. an encoder turns each document into a unit vector (`curate/semantic` embeds shard by shard);
2. the vectors are clustered (k-means, scikit-learn's MiniBatchKMeans, about `cluster_docs` a
   cluster; each document joins its `cluster_probes` nearest clusters), and within each cluster
   every pair at or above `store_min_cosine` is stored
   (`pairs.parquet`: a, b, cosine), so the threshold can move without embedding again;
3. `curate/select` decides among the documents still kept after the filters, document dedup and
   the quality rule: documents in order of quality (the quality classifier's score where it ran,
   then length, then corpus order), each kept unless it is at or above `threshold` to one already
   kept, in which case it is removed (reason `semantic_dup`) as a copy of the most similar one.
   This is semhash's greedy rule with quality order instead of corpus order: the better document
   of a pair stays, and no chain of pairs removes documents that are not themselves similar.

Encoders (`curate.semantic_dedup.encoder`):
- none (default): one built from the corpus itself, offline, nothing downloaded. Word 1..`ngram`
  grams of the near-dedup view (`textnorm.dedup_words`), hashed (scikit-learn's HashingVectorizer),
  weighted by sublinear TF and by IDF counted over the whole corpus (`curate/semantic-encoder`,
  shard by shard), projected to `dim` dimensions by a sparse random projection (scikit-learn's,
  seeded): cosines of the projection estimate the TF-IDF cosines (Johnson-Lindenstrauss). It is
  lexical: it sees reordering, partial synonym swaps and renamed people, not synonymy it was never
  shown; that needs a pretrained encoder.
- a folder: a model2vec static model (`model2vec.StaticModel`, its `config.json` says
  `model2vec`), or any Hugging Face encoder folder (a sentence-transformers one included) run by
  transformers with its pooling (`1_Pooling/config.json`: CLS or mean; mean by default) and
  L2-normalized. Loaded from the folder only: safetensors weights, no network.

By hand: the decision (quality-ordered greedy over stored pairs, kept with scores in
`semantic_pairs.parquet` by select) and the clustered pair search, since semhash decides in record
order over an ANN index and has no notion of quality; `benchmarks/semantic_dedup.py` times the
pair search and decision against semhash's `self_deduplicate` on the same embeddings.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from data_prep.textnorm import dedup_words
from lmforge.errors import ConfigError

REASON = "semantic_dup"
CORPUS = "corpus"
# The corpus encoder's default. On the planted set (tests/paraphrases.py) paraphrases score 0.42-0.9
# and other pairs below 0.36, so 0.4 finds 199 of 200 and 0.5 finds 185; on the demo corpus every
# pair from 0.4 to 0.5 is two different pages on one subject (`object.__radd__` beside
# `object.__iadd__`, two Spanish chats), and the planted near-duplicates MinHash misses start at 0.5.
CORPUS_THRESHOLD = 0.5
PRETRAINED_THRESHOLD = 0.9  # semhash's default for pretrained encoders
N_FEATURES = 2**20


class Encoder(Protocol):
    def encode(self, texts: list[str]) -> np.ndarray: ...


def default_threshold(kind: str) -> float:
    return CORPUS_THRESHOLD if kind == CORPUS else PRETRAINED_THRESHOLD


def _normalize(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)


# -- the corpus encoder ---------------------------------------------------------------------


def _hashing(ngram: int):  # type: ignore[no-untyped-def]
    from sklearn.feature_extraction.text import HashingVectorizer

    return HashingVectorizer(
        n_features=N_FEATURES,
        analyzer="word",
        token_pattern=r"\S+",
        lowercase=False,
        ngram_range=(1, ngram),
        alternate_sign=False,
        norm=None,
        dtype=np.float32,
    )


def _views(texts: list[str]) -> list[str]:
    return [" ".join(dedup_words(t)) for t in texts]


def document_frequencies(texts: list[str], ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """(hashed features present, in how many of `texts` each): one shard's part of the IDF."""
    counts = _hashing(ngram).transform(_views(texts)).tocsc()
    df = np.diff(counts.indptr)
    present = np.flatnonzero(df)
    return present.astype(np.int64), df[present].astype(np.int64)


def idf_from(frequencies: list[tuple[np.ndarray, np.ndarray]], docs: int) -> np.ndarray:
    """Smoothed IDF (scikit-learn's: ln((1 + n) / (1 + df)) + 1) from the shards' frequencies."""
    df = np.zeros(N_FEATURES, dtype=np.int64)
    for present, counts in frequencies:
        np.add.at(df, present, counts)
    return (np.log((1.0 + docs) / (1.0 + df)) + 1.0).astype(np.float32)


def _signs(features: np.ndarray, dim: int, seed: int) -> np.ndarray:
    """The rows of a dense random +-1 projection (Achlioptas) for hashed `features`, made from the
    feature numbers by splitmix64: no matrix of N_FEATURES rows is stored, and the same feature
    always gets the same row."""
    with np.errstate(over="ignore"):
        x = features.astype(np.uint64)[:, None] * np.uint64(dim) + np.arange(dim, dtype=np.uint64)[None, :]
        x = x + np.uint64((seed * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15) % 2**64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return np.where((x & np.uint64(1)).astype(bool), 1.0, -1.0).astype(np.float32)


@dataclass
class CorpusEncoder:
    idf: np.ndarray
    ngram: int
    dim: int
    seed: int
    batch: int = 512

    def encode(self, texts: list[str]) -> np.ndarray:
        import scipy.sparse as sp
        from sklearn.preprocessing import normalize

        hashing, out = _hashing(self.ngram), []
        for start in range(0, len(texts), self.batch):
            counts = hashing.transform(_views(texts[start : start + self.batch])).tocsr()
            counts.data = 1.0 + np.log(counts.data)  # sublinear TF
            weighted = normalize(counts.multiply(self.idf).tocsr()).tocsr()
            present, local = np.unique(weighted.indices, return_inverse=True)  # only the features used
            compact = sp.csr_matrix((weighted.data, local, weighted.indptr), shape=(weighted.shape[0], len(present)))
            out.append(np.asarray(compact @ _signs(present, self.dim, self.seed)))
        return _normalize(np.concatenate(out) if out else np.zeros((0, self.dim), dtype=np.float32))


# -- pretrained encoders --------------------------------------------------------------------


def folder_kind(path: Path) -> str:
    """`model2vec` or `transformers`, from what the folder holds; a clear error otherwise. A model2vec
    folder has `model.safetensors` and `tokenizer.json` and a config.json naming no transformers
    architecture; a Hugging Face one has a config.json with `model_type`."""
    if not path.is_dir():
        raise ConfigError(f"curate.semantic_dedup.encoder: {path} is not a folder")
    config = path / "config.json"
    if not config.is_file():
        raise ConfigError(
            f"curate.semantic_dedup.encoder: {path} has no config.json (a model2vec or Hugging Face encoder folder)"
        )
    try:
        meta = json.loads(config.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"curate.semantic_dedup.encoder: {config} is not JSON ({exc})") from exc
    if meta.get("model_type") == "model2vec":
        return "model2vec"
    if meta.get("model_type") or meta.get("architectures"):
        return "transformers"
    if (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file():
        return "model2vec"
    raise ConfigError(f"curate.semantic_dedup.encoder: {config} names no model_type (not an encoder folder)")


class TransformersEncoder:
    """A Hugging Face encoder folder, pooled as its sentence-transformers config says (mean by default)."""

    def __init__(self, path: Path, batch: int = 32, max_length: int = 512) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        self.model = AutoModel.from_pretrained(str(path), local_files_only=True, use_safetensors=True).eval()
        pooling = path / "1_Pooling" / "config.json"
        self.cls = pooling.is_file() and bool(json.loads(pooling.read_text()).get("pooling_mode_cls_token"))
        self.batch, self.max_length, self.torch = batch, max_length, torch

    def encode(self, texts: list[str]) -> np.ndarray:
        out = []
        with self.torch.inference_mode():
            for start in range(0, len(texts), self.batch):
                enc = self.tokenizer(
                    texts[start : start + self.batch],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                )
                hidden = self.model(**enc).last_hidden_state.float()
                if self.cls:
                    pooled = hidden[:, 0]
                else:
                    mask = enc["attention_mask"].unsqueeze(-1).float()
                    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
                out.append(pooled.numpy())
        return _normalize(np.concatenate(out) if out else np.zeros((0, 1), dtype=np.float32))


class StaticEncoder:
    def __init__(self, path: Path) -> None:
        from model2vec import StaticModel

        self.model = StaticModel.from_pretrained(str(path))

    def encode(self, texts: list[str]) -> np.ndarray:
        return _normalize(np.asarray(self.model.encode(texts)))


def save_corpus_encoder(folder: Path, idf: np.ndarray, ngram: int, dim: int, seed: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "idf.npy", idf, allow_pickle=False)
    spec = {"kind": CORPUS, "ngram": ngram, "dim": dim, "seed": seed, "n_features": N_FEATURES}
    (folder / "encoder.json").write_text(json.dumps(spec, indent=1))


def save_folder_encoder(folder: Path, path: Path) -> str:
    kind = folder_kind(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "encoder.json").write_text(json.dumps({"kind": kind, "path": str(path)}, indent=1))
    return kind


def load_encoder(folder: Path) -> tuple[str, Encoder]:
    """The encoder `curate/semantic-encoder` described in `folder`: (kind, encoder)."""
    spec = json.loads((folder / "encoder.json").read_text())
    kind = spec["kind"]
    if kind == CORPUS:
        idf = np.load(folder / "idf.npy", allow_pickle=False)
        return kind, CorpusEncoder(idf, spec["ngram"], spec["dim"], spec["seed"])
    if kind == "model2vec":
        return kind, StaticEncoder(Path(spec["path"]))
    return kind, TransformersEncoder(Path(spec["path"]))


# -- pairs ----------------------------------------------------------------------------------


def clusters(embeddings: np.ndarray, cluster_docs: int, seed: int, probes: int = 2) -> np.ndarray:
    """The clusters each document joins, shape (documents, probes): k-means on the unit vectors with
    about `cluster_docs` a cluster, and each document in its `probes` nearest clusters, so a pair
    near a boundary is still compared (a single assignment lost a fifth of the planted pairs at
    20,000 documents in 2 clusters). One cluster, every pair compared, when the corpus is no
    bigger than `cluster_docs`."""
    k = math.ceil(len(embeddings) / cluster_docs) if len(embeddings) else 1
    if k <= 1:
        return np.zeros((len(embeddings), 1), dtype=np.int64)
    from sklearn.cluster import MiniBatchKMeans

    km = MiniBatchKMeans(n_clusters=k, random_state=seed, n_init=3, batch_size=max(1024, 4 * k))
    distances = km.fit(embeddings).transform(embeddings)
    return np.argsort(distances, axis=1, kind="stable")[:, : min(probes, k)].astype(np.int64)


def similar_pairs(
    embeddings: np.ndarray, labels: np.ndarray, min_cosine: float, block: int = 2048
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every pair (a < b) sharing a cluster with cosine >= `min_cosine`, exactly, a block of rows at
    a time (memory: block x cluster size); `labels` is `clusters`' (documents, probes) array (or one
    label per document). A pair two clusters share is reported once."""
    labels = labels.reshape(len(embeddings), -1)
    docs = np.repeat(np.arange(len(embeddings)), labels.shape[1])
    flat = labels.reshape(-1)
    order = np.lexsort((docs, flat))  # by cluster, documents ascending within
    cuts = np.flatnonzero(np.diff(flat[order])) + 1
    found_a, found_b, found_c = [], [], []
    for members in np.split(docs[order], cuts) if len(order) else []:
        vectors = embeddings[members]
        for start in range(0, len(members), block):
            sims = vectors[start : start + block] @ vectors.T
            rows, cols = np.nonzero(sims >= min_cosine)
            upper = cols > rows + start
            rows, cols = rows[upper], cols[upper]
            found_a.append(members[rows + start])
            found_b.append(members[cols])
            found_c.append(sims[rows, cols])
    if not found_a:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0, dtype=np.float32)
    a, b, cosine = np.concatenate(found_a), np.concatenate(found_b), np.concatenate(found_c).astype(np.float32)
    _, first = np.unique(a * len(embeddings) + b, return_index=True)  # sorted by (a, b), once each
    return a[first], b[first], cosine[first]


@dataclass
class SemanticDecisions:
    removed: np.ndarray  # document indices removed (semantic_dup), ascending
    kept_copy: np.ndarray  # for each: the kept document it is most similar to
    cosine: np.ndarray  # and their cosine


def decide(
    a: np.ndarray,
    b: np.ndarray,
    cosine: np.ndarray,
    eligible: np.ndarray,
    threshold: float,
    quality: np.ndarray,
    n_chars: np.ndarray,
) -> SemanticDecisions:
    """Greedy in quality order over the pairs at or above `threshold` among `eligible` documents: a
    document is kept unless one already kept is that similar to it."""
    from scipy.sparse import coo_matrix

    take = (cosine >= threshold) & eligible[a] & eligible[b]
    a, b, cosine = a[take], b[take], cosine[take]
    nodes = np.unique(np.concatenate([a, b]))
    if not len(nodes):
        empty = np.zeros(0, dtype=np.int64)
        return SemanticDecisions(empty, empty, np.zeros(0, dtype=np.float32))
    ia, ib = np.searchsorted(nodes, a), np.searchsorted(nodes, b)
    n = len(nodes)
    graph = coo_matrix((np.r_[cosine, cosine], (np.r_[ia, ib], np.r_[ib, ia])), shape=(n, n), dtype=np.float32).tocsr()
    score = np.where(np.isnan(quality[nodes]), -np.inf, quality[nodes])
    order = np.lexsort((nodes, -n_chars[nodes], -score))  # best first; ties: longer, then earlier
    kept = np.zeros(n, dtype=bool)
    removed, copy, cos = [], [], []
    for node in order.tolist():
        lo, hi = graph.indptr[node], graph.indptr[node + 1]
        neighbours, sims = graph.indices[lo:hi], graph.data[lo:hi]
        mine = kept[neighbours]
        if mine.any():
            best = int(np.argmax(np.where(mine, sims, -np.inf)))
            removed.append(node)
            copy.append(neighbours[best])
            cos.append(sims[best])
        else:
            kept[node] = True
    rank = np.argsort(nodes[removed]) if removed else np.zeros(0, dtype=np.int64)
    return SemanticDecisions(
        removed=nodes[np.asarray(removed, dtype=np.int64)][rank],
        kept_copy=nodes[np.asarray(copy, dtype=np.int64)][rank],
        cosine=np.asarray(cos, dtype=np.float32)[rank],
    )
