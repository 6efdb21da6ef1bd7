"""A planted set for the toxicity filter: documents with offensive language (profanity and insults;
no slurs, nothing operational) to mix into the demo corpus, whose documents are all clean.

Two kinds, 40 in all: 30 short offensive posts standing alone (comment threads, reviews, rants),
and 10 long clean demo documents with one offensive paragraph planted among their paragraphs, which
only a filter that scores a long document in windows finds.

Used by tests/test_toxicity_filter.py and benchmarks/toxicity.py (recall, precision, false positives).
"""

from __future__ import annotations

import random

# Standing alone: forum replies, product reviews, chat and comment threads.
POSTS = [
    "You are a fucking idiot. Nobody asked for your stupid opinion, so shut the hell up.",
    "This is the shittiest product I have ever bought. What a load of crap, the people who made it are morons.",
    "Shut up, you worthless piece of shit. Go cry to your mommy.",
    "What a dumbass. Seriously, how can anyone be this stupid? Get lost, loser.",
    "Screw you and your bullshit rules. The mods here are a bunch of pathetic assholes.",
    "Are you brain-dead or just pretending? This is the dumbest fucking take I've read all week.",
    "Go to hell, you ugly bastard. Everyone here hates you.",
    "F*** this game and f*** the devs. Total garbage, they are lying pieces of shit.",
    "lol you're such a pathetic loser, crawl back under your rock you stupid bitch",
    "Holy shit, the referee is a blind moron. Damn idiot ruined the whole fucking match.",
    "Nobody cares, dickhead. Your code is shit and so are you.",
    "Kiss my ass. You are a clueless jackass and your article is worthless crap.",
    "Worst customer service ever. The manager was a rude prick and the staff are idiots. Fuck this place.",
    "Stop posting this crap, you stupid troll. Get a life, jerk.",
    "You absolute moron, learn to read before you open your damn mouth.",
    "This thread is full of dumb fucks who know nothing. Unbelievable shit.",
    "What the fuck is wrong with you people? Bunch of brainless idiots.",
    "Your mom is a fat cow and you are an ugly little shit.",
    "Get the hell out of here with that bullshit, you lying sack of crap.",
    "I hope the idiot who designed this interface gets fired. Absolute garbage, what a bunch of dipshits.",
    "He is a disgusting pig and a total asshole. I can't stand that stupid bastard.",
    "Shut your damn mouth, nobody wants to hear from a loser like you.",
    "This movie sucked ass. Two hours of crap written by morons for morons.",
    "Fuck off and die, you miserable troll.",
    "You're a complete waste of space, you dumb piece of garbage.",
    "Only a total dumbass would buy this crap. The seller is a fucking scammer.",
    "Hey stupid, nobody asked. Go screw yourself.",
    "The author is an arrogant prick who writes bullshit. Don't waste your damn time.",
    "Man, screw this bitch of a landlord. Lazy asshole never fixes anything.",
    "You stupid idiots can't even spell. Pathetic losers, all of you.",
]

# Planted as one paragraph inside a long clean document.
PARAGRAPHS = [
    "Honestly whoever wrote this section is a fucking moron. What a pile of crap.",
    "Edit: to the idiot who keeps deleting my comments, go to hell, you pathetic asshole.",
    "Update: the maintainer is a lazy piece of shit and this whole thing is bullshit.",
    "Shut up, you stupid troll. Nobody cares about your dumb opinion, loser.",
    "If you can't understand this you are a brainless dumbass. Fuck off.",
    "The previous commenter is a clueless jackass, ignore that stupid bastard.",
    "Damn, what a load of garbage. The people behind this are idiots and liars.",
    "Screw you all, this is crap and you are a bunch of morons.",
    "Seriously, what the fuck. Only a complete idiot would ship this shit.",
    "Go screw yourself, you ugly prick. Everyone here thinks you are a joke.",
]


def planted_documents(clean: list[dict], seed: int = 0) -> list[dict]:
    """The 40 planted documents, as {"id", "text", "domain"}: 30 posts and 10 of the longest
    `clean` documents of domain prose/web (at least 5 paragraphs) with one paragraph planted
    at a seeded position (ids "toxic-post-NN", "toxic-inside-NN")."""
    rng = random.Random(seed)
    docs = [{"id": f"toxic-post-{i:02d}", "text": text, "domain": "web"} for i, text in enumerate(POSTS)]
    hosts = sorted(
        (d for d in clean if d["domain"] in ("prose", "web") and d["text"].count("\n\n") >= 4),
        key=lambda d: (-len(d["text"]), d["id"]),
    )
    hosts = rng.sample(hosts[:60], len(PARAGRAPHS))
    for i, (host, paragraph) in enumerate(zip(hosts, PARAGRAPHS)):
        parts = host["text"].split("\n\n")
        at = rng.randrange(1, len(parts))
        text = "\n\n".join([*parts[:at], paragraph, *parts[at:]])
        docs.append({"id": f"toxic-inside-{i:02d}", "text": text, "domain": host["domain"]})
    return docs
