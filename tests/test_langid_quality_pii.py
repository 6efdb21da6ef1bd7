"""Language ID, the quality classifier, PII redaction and domain mixing, on real text."""

from __future__ import annotations

from pathlib import Path

import pytest

from data_prep.config import MixConfig, PIIConfig, QualityClassifierConfig
from data_prep.langid import LanguageIdentifier
from data_prep.mixing import plan_mix
from data_prep.pii import redact
from data_prep.quality import QualityScorer, builtin_reference, train_classifier


def test_language_id_on_real_sentences() -> None:
    texts = {
        "en": "The quick brown fox jumps over the lazy dog while the children watch from the window.",
        "fr": "Le petit chat dort tranquillement sur le canapé pendant que la pluie tombe dehors.",
        "de": "Der kleine Hund spielt im Garten, während die Sonne langsam hinter den Bergen untergeht.",
        "es": "El niño come una manzana roja mientras su madre prepara la cena en la cocina.",
        "ru": "Маленькая кошка спит на диване, пока за окном идёт сильный дождь.",
        "ja": "小さな猫は雨が降っている間、ソファーの上で静かに眠っています。",
    }
    langs, scores = LanguageIdentifier().predict(list(texts.values()))
    assert langs == list(texts)
    assert min(scores) > 0.65


def test_language_id_is_unsure_about_noise() -> None:
    langs, scores = LanguageIdentifier().predict(["xq zzv 1234 %% ## ;;", ""])
    assert scores[0] < 0.65 and langs[1] == "unk" and scores[1] == 0.0


@pytest.fixture(scope="module")
def quality_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spam = [("buy cheap watches best price free shipping click here " * 8 + str(i)) for i in range(150)]
    menus = [
        ("Home | About | Contact | Login | Cart | Privacy Policy | Terms of Use\n" * 5 + str(i)) for i in range(150)
    ]
    path = tmp_path_factory.mktemp("q") / "model.bin"
    metrics = train_classifier(builtin_reference()[:300], spam + menus, QualityClassifierConfig(epochs=5), path)
    assert metrics["heldout_accuracy"] > 0.9
    return path


def test_quality_classifier_prefers_reference_prose(quality_model: Path) -> None:
    scorer = QualityScorer(quality_model)
    prose = (
        "An assignment statement evaluates the expression list and assigns the single resulting object "
        "to each of the target lists, from left to right."
    )
    junk = "cheap watches best price free shipping click here buy now cheap watches"
    good, bad = scorer.score([prose, junk])
    assert good > 0.5 > bad


def test_pii_redaction_counts_each_kind_and_keeps_private_addresses() -> None:
    text = (
        "Write to jane.doe@example.org or call (555) 123-4567 / +44 20 7946 0958. "
        "The server is 93.184.216.34; localhost is 127.0.0.1 and the LAN 192.168.1.10. Python 3.11.7 is used."
    )
    redacted, counts = redact(text, PIIConfig())
    assert counts == {"email": 1, "phone": 2, "ip": 1}
    assert "<EMAIL>" in redacted and "127.0.0.1" in redacted and "192.168.1.10" in redacted and "3.11.7" in redacted
    _, only_email = redact(text, PIIConfig(phone=False, ip=False))
    assert only_email == {"email": 1}
    versions = "Upgrade from v1.2.3.4 to version 2.0.1.5 (ver. 4.3.2.1); the mirror is 8.8.4.4."
    redacted, counts = redact(versions, PIIConfig())
    assert counts == {"ip": 1} and redacted.endswith("mirror is <IP_ADDRESS>.") and "v1.2.3.4" in redacted
    # "version" only as a word: these are addresses
    assert redact("our subversion host 8.8.8.8; please release 1.1.1.1 now", PIIConfig())[1] == {"ip": 2}


def test_mixing_reaches_target_shares_and_respects_the_repeat_cap() -> None:
    docs = (
        [(f"c{i}", "code", 100) for i in range(60)]
        + [(f"p{i}", "prose", 100) for i in range(20)]
        + [(f"d{i}", "dialogue", 100) for i in range(20)]
    )
    repeats, report = plan_mix(docs, MixConfig(weights={"code": 0.5, "prose": 0.3, "dialogue": 0.2}))
    for domain, target in {"code": 0.5, "prose": 0.3, "dialogue": 0.2}.items():
        assert report[domain]["achieved_share"] == pytest.approx(target, abs=0.02)
    assert sum(1 for (doc_id, _, _), r in zip(docs, repeats) if doc_id.startswith("c") and r == 0) > 0
    capped, report = plan_mix(docs, MixConfig(weights={"code": 0.01, "prose": 0.99}, max_repeat=2))
    assert max(capped) <= 2 and report["prose"]["ratio"] == 2
    # the choice follows document ids, not their order in the corpus
    reordered, _ = plan_mix(list(reversed(docs)), MixConfig(weights={"code": 0.5, "prose": 0.3, "dialogue": 0.2}))
    assert list(reversed(reordered)) == repeats


def test_ipv6_is_redacted_in_every_written_form_and_code_is_left_alone() -> None:
    text = (
        "Reach 2001:db8::1 or 2001:0db8:0000:0000:0000:0000:0002:0001, DNS 2606:4700:4700::1111, "
        "mapped ::ffff:93.184.216.34. Local ::1, fe80::1 and fd00::5 stay; x[1::2], std::vector and 12:30:45 too."
    )
    redacted, counts = redact(text, PIIConfig())
    assert counts == {"ip": 4}
    assert "2001:db8::1" not in redacted and "2606:4700" not in redacted and "93.184.216.34" not in redacted
    for kept in ("::1,", "fe80::1", "fd00::5", "x[1::2]", "std::vector", "12:30:45"):
        assert kept in redacted


def test_redact_stored_removes_pii_from_ingested_removed_and_quarantined_text(tmp_path: Path) -> None:
    import json

    from data_prep.config import CurateConfig
    from data_prep.ingest import ingest_file
    from data_prep.records import iter_rows, shard_path

    source = tmp_path / "in.jsonl"
    source.write_text(
        json.dumps({"id": "a", "text": "Mail jane.doe@example.org about host 2001:db8::1 today."})
        + "\n"
        + '{"id": "b", "text": "broken record from bob@example.com\n'
    )
    for stored, expect_pii in ((False, True), (True, False)):
        out = tmp_path / f"out-{stored}"
        _, result = ingest_file(str(source), 0, CurateConfig(pii={"redact_stored": stored}), out)
        text = next(iter_rows(shard_path(out, result["shards"][0]["name"])))["text"]
        quarantined = (out / "quarantine" / "f0000.jsonl").read_text()
        assert ("jane.doe@example.org" in text) == expect_pii and ("2001:db8::1" in text) == expect_pii
        assert ("bob@example.com" in quarantined) == expect_pii
        assert result["pii_redacted"] == ({} if expect_pii else {"email": 2, "ip": 1})
