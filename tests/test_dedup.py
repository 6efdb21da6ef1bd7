"""MinHash-LSH near-duplicate detection and exact/URL dedup decisions."""

from __future__ import annotations

import pydoc_data.topics
import random

import numpy as np

from data_prep.minhash import MinHasher, band_keys, candidate_pairs, estimated_jaccard, exact_jaccard
from data_prep.textnorm import jaccard, shingle_set

PROSE = [t for _, t in sorted(pydoc_data.topics.topics.items()) if len(t.split()) > 300]


def _edit(text: str, rate: float, rng: random.Random) -> str:
    words = text.split()
    return " ".join(rng.choice(words) if rng.random() < rate else w for w in words)


def test_shingle_hashes_give_the_exact_jaccard_of_shingle_sets() -> None:
    rng = random.Random(0)
    hasher = MinHasher()
    for base in PROSE[:5]:
        other = _edit(base, 0.1, rng)
        assert exact_jaccard(hasher.shingles(base), hasher.shingles(other)) == jaccard(
            shingle_set(base, 5), shingle_set(other, 5)
        )


def test_signature_agreement_estimates_jaccard() -> None:
    rng = random.Random(1)
    hasher = MinHasher()
    errors = []
    for base in PROSE[:20]:
        other = _edit(base, 0.05, rng)
        sig = hasher.signatures([base, other])
        errors.append(estimated_jaccard(sig[0], sig[1]) - jaccard(shingle_set(base, 5), shingle_set(other, 5)))
    assert abs(np.mean(errors)) < 0.03 and np.mean(np.abs(errors)) < 0.08


def test_signatures_do_not_depend_on_batching() -> None:
    hasher = MinHasher()
    texts = PROSE[:6] + ["", "one two"]
    together = hasher.signatures(texts)
    apart = np.concatenate([hasher.signatures([t]) for t in texts])
    assert np.array_equal(together, apart)
    assert (together[6] == np.iinfo(np.uint64).max).all()  # empty document


def test_signatures_are_datasketch_minhash_bit_for_bit() -> None:
    """The vectorized path computes exactly datasketch's affine64 MinHash of the shingle keys,
    and its band buckets propose exactly the pairs datasketch's MinHashLSH proposes."""
    from datasketch import LeanMinHash, MinHash, MinHashLSH

    rng = random.Random(3)
    hasher = MinHasher()
    texts = [t for base in PROSE[:12] for t in (base, _edit(base, rng.choice([0.01, 0.05, 0.2]), rng))]
    signatures = hasher.signatures(texts)
    lsh = MinHashLSH(num_perm=112, params=(14, 8))
    expected = set()
    for index, (text, signature) in enumerate(zip(texts, signatures)):
        reference = MinHash(num_perm=112, seed=1, scheme="affine64", hashfunc=int)
        reference.update_batch(hasher.shingle_keys(text).tolist())
        assert np.array_equal(reference.hashvalues, signature)
        lean = LeanMinHash(seed=1, hashvalues=signature, scheme="affine64")
        expected |= {(int(other), index) for other in lsh.query(lean)}
        lsh.insert(str(index), lean)
    found = {(int(a), int(b)) for a, b in candidate_pairs(band_keys(signatures, 14, 8))}
    assert found == expected and expected


def test_lsh_finds_near_duplicates_with_high_precision_and_recall() -> None:
    """Pairs at known edit rates: candidates + exact verification recover those with J >= 0.8."""
    rng = random.Random(2)
    hasher = MinHasher()
    texts, truth = [], {}
    for base in PROSE[:40]:
        rate = rng.choice([0.01, 0.03, 0.05, 0.1, 0.2])
        other = _edit(base, rate, rng)
        texts += [base, other]
        truth[(len(texts) - 2, len(texts) - 1)] = jaccard(shingle_set(base, 5), shingle_set(other, 5))
    pairs = candidate_pairs(band_keys(hasher.signatures(texts), 14, 8))
    shingles = [hasher.shingles(t) for t in texts]
    found = {(int(a), int(b)) for a, b in pairs if exact_jaccard(shingles[a], shingles[b]) >= 0.8}
    positives = {p for p, j in truth.items() if j >= 0.8}
    assert positives, "the generated set must contain true near-duplicates"
    recall = len(found & positives) / len(positives)
    precision = len(found & positives) / max(len(found), 1)
    assert recall >= 0.9 and precision >= 0.95


def test_clusters_are_connected_components_above_the_threshold(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_prep.select import near_duplicate_clusters

    path = tmp_path / "edges.parquet"
    pq.write_table(pa.table({"a": [5, 3, 7, 1], "b": [3, 9, 8, 2], "jaccard": [0.9, 0.85, 0.95, 0.6]}), path)
    assert near_duplicate_clusters(path, 0.8) == [[3, 5, 9], [7, 8]]  # 1-2 is below the threshold
    assert sorted(near_duplicate_clusters(path, 0.5)) == [[1, 2], [3, 5, 9], [7, 8]]
    assert near_duplicate_clusters(path, 0.99) == []


def test_big_buckets_stay_linear() -> None:
    keys = np.zeros((500, 1), dtype=np.uint64)  # 500 identical documents in one bucket
    pairs = candidate_pairs(keys)
    assert len(pairs) == 499 and (pairs[:, 0] == 0).all()


def test_clusters_at_threshold_include_their_roots(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_prep.select import near_duplicate_clusters

    path = tmp_path / "edges.parquet"
    pq.write_table(pa.table({"a": [1, 2, 7], "b": [2, 5, 9], "jaccard": [0.9, 0.85, 0.6]}), path)
    assert near_duplicate_clusters(path, 0.8) == [[1, 2, 5]]
    assert sorted(near_duplicate_clusters(path, 0.5)) == [[1, 2, 5], [7, 9]]


def test_dedup_word_bytes_are_dedup_words_on_every_character() -> None:
    """The fast word split must give exactly textnorm's words, or signatures would change."""
    from data_prep.minhash import dedup_word_bytes
    from data_prep.textnorm import dedup_words

    every = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    samples = [every[i : i + 997] + " Ab1 Ç 2x" for i in range(0, len(every), 997)]  # non-ASCII path
    samples += ["X" + every[i : i + 61] + "y5" for i in range(0, len(every), 61)]  # each character between words
    samples += ["".join(map(chr, range(128))), "Hello, World! 3.14 don't_stop  tab\there", ""] + PROSE[:20]
    for text in samples:
        assert [w.decode() for w in dedup_word_bytes(text)] == dedup_words(text), text[:40]


def test_batches_give_the_keys_and_shingles_of_single_documents() -> None:
    hasher = MinHasher()
    texts = PROSE[:5] + ["", "one two", "a b c d", "a b c d e", "Ünïcödé wörds 42 here"]
    keys, bounds = hasher.batch_keys(texts)
    for i, text in enumerate(texts):
        assert np.array_equal(keys[bounds[i] : bounds[i + 1]], hasher.shingle_keys(text))
    assert [len(hasher.shingle_keys(t)) for t in texts[5:]] == [0, 1, 1, 1, 1]
    for text, shingles in zip(texts, hasher.shingle_sets(texts)):
        assert np.array_equal(shingles, hasher.shingles(text))
        assert len(shingles) == len(shingle_set(text, 5))


def test_candidate_pairs_are_every_pair_of_small_buckets_and_stars_of_big_ones() -> None:
    import itertools
    from collections import defaultdict

    rng = np.random.default_rng(0)
    keys = rng.integers(0, 400, size=(3000, 3)).astype(np.uint64)  # buckets of ~7.5 documents
    keys[rng.random(3000) < 0.03, 1] = 7  # one bucket of ~90 (> 32: a star)
    expected = set()
    for band in range(keys.shape[1]):
        buckets = defaultdict(list)
        for doc, key in enumerate(keys[:, band]):
            buckets[int(key)].append(doc)
        for members in buckets.values():
            pairs = itertools.combinations(members, 2) if len(members) <= 32 else ((members[0], m) for m in members[1:])
            expected.update(pairs)
    found = candidate_pairs(keys)
    assert {(int(a), int(b)) for a, b in found} == expected
    assert len(found) == len(expected) and (np.diff(found[:, 0]) >= 0).all()


def test_exact_jaccard_of_sorted_arrays() -> None:
    rng = np.random.default_rng(1)
    for _ in range(200):
        a = np.unique(rng.integers(0, 60, size=rng.integers(0, 40)).astype(np.uint64))
        b = np.unique(rng.integers(0, 60, size=rng.integers(0, 40)).astype(np.uint64))
        union = len(set(a.tolist()) | set(b.tolist()))
        assert exact_jaccard(a, b) == (len(set(a.tolist()) & set(b.tolist())) / union if union else 1.0)


def test_first_of_equal_points_every_row_at_its_first_copy() -> None:
    from data_prep.select import first_of_equal

    rows = np.array([[5, 1], [2, 2], [5, 1], [5, 2], [2, 2], [5, 1]], dtype=np.uint64)
    assert first_of_equal(rows).tolist() == [0, 1, 0, 3, 1, 0]
    assert first_of_equal(np.zeros((0, 2), dtype=np.uint64)).tolist() == []


# -- paragraph dedup and the held-out split ---------------------------------------------------


def _corpus_columns(texts: list[str]) -> dict[str, np.ndarray]:
    from data_prep.paragraphs import shard_columns

    return shard_columns(texts)  # one shard: rows are corpus indices


def test_a_paragraph_copied_into_many_documents_is_kept_once_in_the_first() -> None:
    from data_prep.paragraphs import decide

    planted = "This licence text was copied, word for word, into every one of these pages by a template."
    rng = random.Random(3)
    texts = []
    for i in range(9):
        own = [" ".join(rng.choice(PROSE[i].split()) for _ in range(40)) for _ in range(3)]
        texts.append("\n\n".join([own[0], planted if i % 2 else planted.upper() + "!", *own[1:]]))
    texts.append(planted + "\n\n" + "short tail")  # mostly the planted paragraph: removed whole
    decided = decide(_corpus_columns(texts), np.ones(len(texts), dtype=bool), 50, 0.5)
    # case and punctuation do not make a different paragraph; document 0 holds the first copy
    assert decided.doc.tolist() == list(range(1, 9)) and set(decided.number.tolist()) == {1}
    assert set(decided.owner.tolist()) == {0}
    assert decided.removed_docs.tolist() == [9] and decided.removed_owner.tolist() == [0]


def test_a_removed_first_holder_passes_its_paragraphs_to_the_next_document() -> None:
    from data_prep.paragraphs import decide

    shared = ["Paragraph one is long enough to count as a paragraph of real text here.", "Second " * 12]
    unique = "A paragraph only the second document has, long enough to be counted as one."
    texts = [
        "\n\n".join(shared),  # not eligible (an earlier rule removed it): holds nothing
        "\n\n".join([*shared, unique]),
        "\n\n".join([unique, *shared]),  # every paragraph repeated: removed whole
        "\n\n".join([shared[0], "and a much longer paragraph of its own " * 10]),
    ]
    eligible = np.array([False, True, True, True])
    decided = decide(_corpus_columns(texts), eligible, 50, 0.5)
    assert decided.removed_docs.tolist() == [2] and decided.removed_owner.tolist() == [1]
    assert list(zip(decided.doc.tolist(), decided.number.tolist(), decided.owner.tolist())) == [(3, 0, 1)]


def test_short_paragraphs_are_never_repeats() -> None:
    from data_prep.paragraphs import decide

    texts = ["Usage\n\n" + "alpha beta gamma " * 10, "Usage\n\n" + "delta epsilon zeta " * 10]
    decided = decide(_corpus_columns(texts), np.ones(2, dtype=bool), 50, 0.5)
    assert len(decided.doc) == 0 and len(decided.removed_docs) == 0


def test_documents_sharing_text_are_held_out_together_and_a_giant_group_stays_in_training() -> None:
    from data_prep.split import decide_split, groups, linked_pairs, shard_keys

    rng = random.Random(5)
    vocabulary = [w for text in PROSE for w in text.split()][:20000]

    def fresh(n: int) -> str:
        return " ".join(rng.choice(vocabulary) for _ in range(n))

    quoted = fresh(30)
    stock = "thank you for reading and see you next time"  # in every document: links none
    texts = [f"{fresh(60)} {quoted} {stock}", f"{stock} {fresh(40)} {quoted}"]  # 0 and 1 share a passage
    texts.append(f"{fresh(50)} {' '.join(quoted.split()[:10])} {stock}")  # 2 shares 3 8-grams with them: too few
    giant = fresh(40)
    texts += [f"{fresh(30)} {giant} {stock}" for _ in range(20)]  # 3..22: one group of 20
    texts += [f"{fresh(80)} {stock}" for _ in range(200)]
    columns = shard_keys(texts, 8)
    pairs = linked_pairs(columns["key"], columns["doc"], len(texts), min_shared=5, max_docs=50)
    root = groups(pairs, len(texts))
    assert root[1] == 0 and root[0] == 0 and root[2] == 2
    assert set(root[3:23].tolist()) == {3} and (root[23:] == np.arange(23, len(texts))).all()
    ids = [f"doc-{i}" for i in range(len(texts))]
    held, counts = decide_split(ids, root, 0.5, 0, None)  # groups above 0.25 of the documents stay in training
    assert held[0] == held[1] and len(set(held[3:23].tolist())) == 1  # the group of 20 (9%): one side, by its hash
    held, counts = decide_split(ids, root, 0.08, 0, None)  # above 0.04 of the documents it always trains
    assert not held[3:23].any() and counts["too_large_groups"] == 1 and counts["docs_in_too_large_groups"] == 20
    assert 0.03 < held.mean() < 0.13 and held[0] == held[1]
    by_id, _ = decide_split(ids, np.arange(len(texts)), 0.08, 0, None)  # split_by: id, the old rule
    assert 0.03 < by_id.mean() < 0.13


# -- semantic dedup (data_prep/semantic.py) --------------------------------------------------


def _corpus_embeddings(texts: list[str]) -> np.ndarray:
    from data_prep import semantic

    frequencies = [semantic.document_frequencies(texts[i : i + 700], 2) for i in range(0, len(texts), 700)]
    return semantic.CorpusEncoder(semantic.idf_from(frequencies, len(texts)), 2, 512, 0).encode(texts)


def test_semantic_dedup_finds_the_paraphrases_minhash_misses_on_the_planted_set() -> None:
    """The issue's planted set: 2,000 documents, 200 of them paraphrases (sentences reordered,
    synonyms and names swapped). Recall and false positives of both rules on the same pairs."""
    from data_prep import semantic
    from tests.paraphrases import planted_set

    planted = planted_set()
    truth, n = planted.pairs(), len(planted.texts)
    hasher = MinHasher()
    shingles = [hasher.shingles(t) for t in planted.texts]
    minhash_found = sum(exact_jaccard(shingles[a], shingles[b]) >= 0.8 for a, b in truth)
    assert minhash_found == 0  # what the issue is about: MinHash at its threshold sees none of them

    embeddings = _corpus_embeddings(planted.texts)
    a, b, cosine = semantic.similar_pairs(embeddings, semantic.clusters(embeddings, 10000, 0), 0.3)
    for threshold, least in ((0.4, 0.97), (semantic.CORPUS_THRESHOLD, 0.9)):  # the set's best, and the default
        at = cosine >= threshold
        found = set(zip(a[at].tolist(), b[at].tolist()))
        recall, false = len(found & truth) / len(truth), len(found - truth)
        assert recall >= least and false <= 2, (threshold, recall, false)
        assert false / (n * (n - 1) / 2 - len(truth)) < 1e-5

    # the decision removes one document of each planted pair, and nothing else
    d = semantic.decide(a, b, cosine, np.ones(n, bool), 0.4, np.full(n, np.nan), np.ones(n))
    removed = set(d.removed.tolist())
    one_of_pair = sum((x in removed) != (y in removed) for x, y in planted.paraphrase_of.items())
    assert one_of_pair >= 0.97 * len(truth) and len(removed) <= len(truth) + 2


def test_semantic_decisions_keep_the_better_document_and_do_not_chain() -> None:
    from data_prep import semantic

    # 0~1 (0.95), 1~2 (0.92), 0 and 2 not similar: keeping 1 (best quality) removes both others;
    # keeping 0 first would keep 2 too (no chain through a removed document)
    a, b, cos = np.array([0, 1]), np.array([1, 2]), np.array([0.95, 0.92], dtype=np.float32)
    quality = np.array([0.2, 0.9, 0.1])
    d = semantic.decide(a, b, cos, np.ones(3, bool), 0.9, quality, np.ones(3))
    assert d.removed.tolist() == [0, 2] and d.kept_copy.tolist() == [1, 1]
    quality = np.array([0.9, 0.2, 0.8])
    d = semantic.decide(a, b, cos, np.ones(3, bool), 0.9, quality, np.ones(3))
    assert d.removed.tolist() == [1] and d.kept_copy.tolist() == [0]
    # no quality score: the longer document stays; a document not eligible takes no part
    d = semantic.decide(a, b, cos, np.ones(3, bool), 0.9, np.full(3, np.nan), np.array([10, 5, 30]))
    assert d.removed.tolist() == [1] and d.kept_copy.tolist() == [0]  # the most similar kept one
    d = semantic.decide(a, b, cos, np.array([True, False, True]), 0.9, np.full(3, np.nan), np.ones(3))
    assert len(d.removed) == 0
    # below the threshold nothing is a duplicate
    assert len(semantic.decide(a, b, cos, np.ones(3, bool), 0.96, quality, np.ones(3)).removed) == 0


def test_pairs_within_clusters_are_exact_and_the_corpus_encoder_is_deterministic() -> None:
    from data_prep import semantic

    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(300, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    a, b, cos = semantic.similar_pairs(vectors, np.zeros(300, dtype=np.int64), 0.5, block=64)
    sims = vectors @ vectors.T
    want = {(i, j) for i, j in zip(*np.nonzero(sims >= 0.5)) if i < j}
    assert set(zip(a.tolist(), b.tolist())) == want and np.allclose(cos, sims[a, b])
    # two clusters: only pairs inside one are compared
    labels = (np.arange(300) % 2).astype(np.int64)
    a, b, _ = semantic.similar_pairs(vectors, labels, 0.5)
    assert set(zip(a.tolist(), b.tolist())) == {(i, j) for i, j in want if (i - j) % 2 == 0}
    # each document in two of three clusters (probes): a pair sharing either is found, and once
    probes = np.stack([np.arange(300) % 3, (np.arange(300) + 1) % 3], axis=1).astype(np.int64)
    a, b, _ = semantic.similar_pairs(vectors, probes, 0.5)
    shared = {(i, j) for i, j in want if set(probes[i]) & set(probes[j])}
    assert sorted(zip(a.tolist(), b.tolist())) == sorted(shared) and len(shared) == len(want)
    labels = semantic.clusters(vectors, 100, 0, probes=2)
    assert labels.shape == (300, 2) and (labels[:, 0] != labels[:, 1]).all()

    texts = PROSE[:12]
    first, again = _corpus_embeddings(texts), _corpus_embeddings(list(texts))
    assert np.array_equal(first, again) and np.allclose(np.linalg.norm(first, axis=1), 1.0, atol=1e-5)
    batched = semantic.CorpusEncoder(
        semantic.idf_from([semantic.document_frequencies(texts, 2)], 12), 2, 512, 0, batch=5
    )
    assert np.allclose(batched.encode(texts), first, atol=1e-6)


def test_pretrained_encoder_folders_load_offline_and_embed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A model2vec static model and a Hugging Face encoder folder (built here: no hub) as
    `curate.semantic_dedup.encoder`; a folder that is neither is a one-line error."""
    import json

    import pytest
    from model2vec import StaticModel
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    from data_prep import semantic
    from lmforge.errors import ConfigError

    texts = ["the cat sat on the mat", "a dog ran far away", "the cat sat on the mat"]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]", "[CLS]"]))
    vectors = np.random.default_rng(0).normal(size=(tok.get_vocab_size(), 8)).astype(np.float32)
    StaticModel(vectors=vectors, tokenizer=tok, normalize=True).save_pretrained(tmp_path / "m2v")
    BertModel(BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(tmp_path / "bert")  # fmt: skip
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(
        tmp_path / "bert"
    )
    for name, kind in (("m2v", "model2vec"), ("bert", "transformers")):
        folder = tmp_path / f"spec-{name}"
        assert semantic.save_folder_encoder(folder, tmp_path / name) == kind
        loaded_kind, encoder = semantic.load_encoder(folder)
        embedded = encoder.encode(texts)
        assert loaded_kind == kind and embedded.shape[0] == 3 and embedded.dtype == np.float32
        assert np.allclose(np.linalg.norm(embedded, axis=1), 1.0, atol=1e-5)
        assert embedded[0] @ embedded[2] > 0.999 and embedded[0] @ embedded[1] < 0.999
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(ConfigError, match="names no model_type"):
        semantic.folder_kind(tmp_path / "other")
    with pytest.raises(ConfigError, match="is not a folder"):
        semantic.folder_kind(tmp_path / "missing")
    from lmforge.config import load_config

    missing = [f"curate.semantic_dedup.encoder={tmp_path / 'missing'}", "curate.semantic_dedup.enabled=true"]
    with pytest.raises(ConfigError, match=r"curate\.semantic_dedup\.encoder: .*missing is not a folder"):
        load_config("tiny-cpu", missing, str(tmp_path / "ws"))
