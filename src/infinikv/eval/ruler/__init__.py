"""RULER's synthetic long-context tasks, offline: deterministic prompt generators and scoring.

RULER (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language
Models?", 2024) is what KV-cache papers and kvpress's leaderboard rank policies with. Its tasks
need no dataset: each prompt is a haystack (repeated noise sentences, a real text, or distractor
needles) with answers hidden in it, so they are rebuilt here from the packaged texts and a
built-in word list. Only the tokenizer is used; running a model is the caller's part.

Each prompt is the chat-free template followed by the task's answer prefix, and is exactly
``length`` tokens: ``prompt_ids`` is the concatenation of separately tokenized pieces
(instruction, haystack units, needles, question + answer prefix), and the haystack is cut to the
token to make the total exact, so the prompt *is* those ids (re-encoding the decoded text may
merge a token or two at piece boundaries). Needles go between haystack units (sentences, noise
lines, list entries) at the unit boundary nearest to their depth; ``Sample.depths`` are the
depths they actually got, as fractions of the haystack (0 = right after the instruction,
1 = right before the question). The answer-bearing needle of sample ``i`` of ``n`` goes at depth
``i / (n - 1)``; other needles go at random depths. Randomness comes only from
``random.Random`` seeded with (task, length, seed, sample index).

| task | haystack | hides | asks | new tokens |
|---|---|---|---|---|
| ``niah_single_1`` | noise lines | one word key -> 7-digit number | that number | 16 |
| ``niah_single_2`` | the text | one word key -> 7-digit number | that number | 16 |
| ``niah_single_3`` | the text | one word key -> UUID | that UUID | 48 |
| ``niah_multikey_1`` | the text | 4 word keys -> numbers | one key's number | 16 |
| ``niah_multikey_2`` | distractor needles | one word key -> number among needles with other keys | its number | 16 |
| ``niah_multikey_3`` | distractor needles | one UUID key -> UUID among needles with other keys | its UUID | 48 |
| ``niah_multivalue`` | the text | 4 numbers for one word key | all 4 | 48 |
| ``niah_multiquery`` | the text | 4 word keys -> numbers | all 4 keys' numbers | 48 |
| ``vt`` | noise lines | ``VAR A = 12345``, 4 hops ``VAR B = VAR A`` ... (+ an example) | all 5 names | 32 |
| ``cwe`` | none | a numbered word list, 10 words far more often (+ an example) | the 10 common words | 64 |
| ``fwe`` | none | coded words drawn from a Zipf law (alpha 2), ``...`` the commonest | the next 3 | 32 |

Every task is scored with ``string_match_all`` (the fraction of a sample's answers that appear
in its output, case-insensitive; RULER's metric for niah, vt, cwe and fwe); ``string_match_part``
(1 if any answer appears) is RULER's metric for its QA tasks, which need SQuAD/HotpotQA downloads
and are not generated here. Scores are in [0, 1]; RULER's tables are these x100.

``max_new_tokens`` (RULER: 128 niah, 30 vt, 120 cwe, 50 fwe) is cut to about twice the answer's
length with the SmolLM2 tokenizer (which splits digits: a 7-digit number is 9 tokens, a UUID 37,
five variable names about 20, ten numbered words about 50), since a small model that has the
answer gives it at once and every extra decode step costs.

Differences from RULER, all deliberate: the essay haystack is any text (the packaged Austen
novels by default) split into sentences by a regex instead of Paul Graham's essays and NLTK;
keys come from a built-in adjective-noun list instead of ``wonderwords``; in the noise and
distractor haystacks each noise block, needle and variable assignment is a line of its own; the
answer prefixes have no trailing space (so a BPE model's next token can carry its own); ``vt``'s
prefix says "assigned" where RULER's says "assgined"; cwe's words are drawn from a 719-word
list, so past the lengths it can fill, every word's repeat count is multiplied (common:uncommon
stays 10:1).

Templates (``{context}`` is the haystack; the answer prefix follows the question directly):

- niah, one answer: ``NIAH_TEMPLATE_ONE`` + ``NIAH_ANSWER_PREFIX_ONE``, more than one:
  ``NIAH_TEMPLATE`` + ``NIAH_ANSWER_PREFIX``; each needle is ``NEEDLE``.
- vt: ``VT_TEMPLATE`` + ``VT_ANSWER_PREFIX``; cwe: ``CWE_TEMPLATE`` + ``CWE_ANSWER_PREFIX``;
  fwe: ``FWE_TEMPLATE`` + ``FWE_ANSWER_PREFIX``.
"""

from .generators import generate
from .metrics import score, string_match_all, string_match_part
from .tasks import TASKS, Sample, Task, task_names

__all__ = ["TASKS", "Sample", "Task", "generate", "score", "string_match_all", "string_match_part", "task_names"]
