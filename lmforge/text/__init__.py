"""Text helpers several stages share: n-gram keys and matching (`textkeys`, `textmatch`), chat
rendering (`chat`), HumanEval's items (`humaneval`) and answer verification (`verify`)."""
