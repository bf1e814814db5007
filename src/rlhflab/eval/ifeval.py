"""IFEval's instruction checkers: a documented subset, ported check for check (pure Python).

Source: Zhou et al. 2023, "Instruction-Following Evaluation for Large Language Models", arXiv
2311.07911; the checkers of github.com/google-research/google-research,
`instruction_following_eval/instructions.py` (`check_following` of each class) and the strict /
loose scoring of `evaluation_lib.py` (`test_instruction_following_strict|loose`), which
lm-evaluation-harness's `ifeval` task copies.

Supported (19 of the 25 instruction ids of google/IFEval, each the original's regular
expressions and comparisons): punctuation:no_comma; detectable_format:title,
number_bullet_lists, number_highlighted_sections, multiple_sections, json_format,
constrained_response; detectable_content:postscript, number_placeholders; startend:end_checker,
quotation; keywords:existence, forbidden_words, frequency, letter_frequency;
length_constraints:number_paragraphs, nth_paragraph_first_word; combination:two_responses,
repeat_prompt.

Not supported (they need `langdetect` or NLTK's tokenizers, which rlhflab does not depend on):
language:response_language, change_case:english_lowercase, change_case:english_capital,
change_case:capital_word_frequency, length_constraints:number_words,
length_constraints:number_sentences. A prompt with one of them is left out of the scores and
counted (`rlhflab.eval.benchmarks`), so a result on a file that has them is over a subset of the
prompts and is not comparable with published IFEval numbers (which are over all 541).
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Callable

_RELATIONS = ("less than", "at least")
_CONSTRAINED = ("My answer is yes.", "My answer is no.", "My answer is maybe.")


def _compare(count: int, relation: str, target: int) -> bool:
    """IFEval's relation: "less than" is count < target, otherwise (at least) count >= target."""
    if relation not in _RELATIONS:
        raise ValueError(f"relation must be one of {_RELATIONS}, got {relation!r}")
    return count < target if relation == _RELATIONS[0] else count >= target


def no_comma(value: str) -> bool:
    """punctuation:no_comma — no "," anywhere."""
    return not re.search(r"\,", value)


def title(value: str) -> bool:
    """detectable_format:title — a non-empty <<title>> on one line."""
    return any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", value))


def number_bullet_lists(value: str, *, num_bullets: int) -> bool:
    """detectable_format:number_bullet_lists — exactly `num_bullets` "* " or "- " lines."""
    stars = re.findall(r"^\s*\*[^\*].*$", value, flags=re.MULTILINE)
    dashes = re.findall(r"^\s*-.*$", value, flags=re.MULTILINE)
    return len(stars) + len(dashes) == num_bullets


def number_highlighted_sections(value: str, *, num_highlights: int) -> bool:
    """detectable_format:number_highlighted_sections — at least `num_highlights` non-empty
    *highlighted* (or **bold**) spans."""
    count = 0
    for h in re.findall(r"\*[^\n\*]*\*", value):
        count += bool(h.strip("*").strip())
    for h in re.findall(r"\*\*[^\n\*]*\*\*", value):
        count += bool(h.removeprefix("**").removesuffix("**").strip())
    return count >= num_highlights


def multiple_sections(value: str, *, section_spliter: str, num_sections: int) -> bool:
    """detectable_format:multiple_sections — at least `num_sections` "<SPLITER> <n>" markers."""
    pattern = r"\s?" + section_spliter.strip() + r"\s?\d+\s?"
    return len(re.split(pattern, value)) - 1 >= num_sections


def json_format(value: str) -> bool:
    """detectable_format:json_format — the whole response (markdown fences allowed) is JSON."""
    value = (
        value.strip()
        .removeprefix("```json")
        .removeprefix("```Json")
        .removeprefix("```JSON")
        .removeprefix("```")
        .removesuffix("```")
        .strip()
    )
    try:
        json.loads(value)
    except ValueError:
        return False
    return True


def constrained_response(value: str) -> bool:
    """detectable_format:constrained_response — contains "My answer is yes/no/maybe."."""
    value = value.strip()
    return any(option in value for option in _CONSTRAINED)


def postscript(value: str, *, postscript_marker: str) -> bool:
    """detectable_content:postscript — a line with the marker (P.S. / P.P.S / other)."""
    marker = postscript_marker.strip()
    if marker == "P.P.S":
        pattern = r"\s*p\.\s?p\.\s?s.*$"
    elif marker == "P.S.":
        pattern = r"\s*p\.\s?s\..*$"
    else:
        pattern = r"\s*" + marker.lower() + r".*$"
    return bool(re.findall(pattern, value.lower(), flags=re.MULTILINE))


def number_placeholders(value: str, *, num_placeholders: int) -> bool:
    """detectable_content:number_placeholders — at least `num_placeholders` [placeholders]."""
    return len(re.findall(r"\[.*?\]", value)) >= num_placeholders


def end_checker(value: str, *, end_phrase: str) -> bool:
    """startend:end_checker — ends with `end_phrase` (case-insensitive, outer quotes ignored)."""
    return value.strip().strip('"').lower().endswith(end_phrase.strip().lower())


def quotation(value: str) -> bool:
    """startend:quotation — wrapped in double quotation marks."""
    value = value.strip()
    return len(value) > 1 and value[0] == '"' and value[-1] == '"'


def existence(value: str, *, keywords: list[str]) -> bool:
    """keywords:existence — every keyword found (regex search, case-insensitive)."""
    return all(re.search(k, value, flags=re.IGNORECASE) for k in keywords)


def forbidden_words(value: str, *, forbidden_words: list[str]) -> bool:
    """keywords:forbidden_words — no forbidden word as a whole word (case-insensitive)."""
    words = sorted(set(forbidden_words))
    return not any(re.search(r"\b" + w + r"\b", value, flags=re.IGNORECASE) for w in words)


def frequency(value: str, *, keyword: str, frequency: int, relation: str) -> bool:
    """keywords:frequency — occurrences of `keyword` (case-insensitive) < or >= `frequency`."""
    count = len(re.findall(keyword.strip(), value, flags=re.IGNORECASE))
    return _compare(count, relation, frequency)


def letter_frequency(value: str, *, letter: str, let_frequency: int, let_relation: str) -> bool:
    """keywords:letter_frequency — occurrences of `letter` (case-insensitive) < or >= the
    frequency."""
    count = collections.Counter(value.lower())[letter.strip().lower()]
    return _compare(count, let_relation, let_frequency)


def number_paragraphs(value: str, *, num_paragraphs: int) -> bool:
    """length_constraints:number_paragraphs — exactly `num_paragraphs` paragraphs separated by
    the markdown divider `***` (an empty paragraph inside: not followed)."""
    paragraphs = re.split(r"\s?\*\*\*\s?", value)
    count = len(paragraphs)
    for i, paragraph in enumerate(paragraphs):
        if not paragraph.strip():
            if i == 0 or i == len(paragraphs) - 1:
                count -= 1
            else:
                return False
    return count == num_paragraphs


def nth_paragraph_first_word(
    value: str, *, num_paragraphs: int, nth_paragraph: int, first_word: str
) -> bool:
    """length_constraints:nth_paragraph_first_word — `num_paragraphs` paragraphs split by a
    blank line, paragraph `nth_paragraph` (from 1) starting with `first_word`."""
    paragraphs = re.split(r"\n\n", value)
    count = len(paragraphs) - sum(1 for p in paragraphs if not p.strip())
    if nth_paragraph > count:
        return False
    paragraph = paragraphs[nth_paragraph - 1].strip()
    if not paragraph:
        return False
    word = paragraph.split()[0].strip().lstrip("'").lstrip('"')
    first = ""
    for letter in word:
        if letter in {".", ",", "?", "!", "'", '"'}:
            break
        first += letter.lower()
    return count == num_paragraphs and first == first_word.lower()


def two_responses(value: str) -> bool:
    """combination:two_responses — two different responses separated by "******"."""
    valid = []
    responses = value.split("******")
    for i, response in enumerate(responses):
        if not response.strip():
            if i != 0 and i != len(responses) - 1:
                return False
        else:
            valid.append(response)
    return len(valid) == 2 and valid[0].strip() != valid[1].strip()


def repeat_prompt(value: str, *, prompt_to_repeat: str) -> bool:
    """combination:repeat_prompt — starts with `prompt_to_repeat` (case-insensitive)."""
    return value.strip().lower().startswith(prompt_to_repeat.strip().lower())


#: instruction id (google/IFEval's `instruction_id_list`) -> check(response, **kwargs) -> bool
CHECKERS: dict[str, Callable[..., bool]] = {
    "punctuation:no_comma": no_comma,
    "detectable_format:title": title,
    "detectable_format:number_bullet_lists": number_bullet_lists,
    "detectable_format:number_highlighted_sections": number_highlighted_sections,
    "detectable_format:multiple_sections": multiple_sections,
    "detectable_format:json_format": json_format,
    "detectable_format:constrained_response": constrained_response,
    "detectable_content:postscript": postscript,
    "detectable_content:number_placeholders": number_placeholders,
    "startend:end_checker": end_checker,
    "startend:quotation": quotation,
    "keywords:existence": existence,
    "keywords:forbidden_words": forbidden_words,
    "keywords:frequency": frequency,
    "keywords:letter_frequency": letter_frequency,
    "length_constraints:number_paragraphs": number_paragraphs,
    "length_constraints:nth_paragraph_first_word": nth_paragraph_first_word,
    "combination:two_responses": two_responses,
    "combination:repeat_prompt": repeat_prompt,
}
#: the ids of google/IFEval that need langdetect / NLTK (not supported, see the module doc)
UNSUPPORTED: tuple[str, ...] = (
    "language:response_language",
    "change_case:english_lowercase",
    "change_case:english_capital",
    "change_case:capital_word_frequency",
    "length_constraints:number_words",
    "length_constraints:number_sentences",
)


def _loose_variants(response: str) -> list[str]:
    """The 8 variants of `test_instruction_following_loose`: the response, without its first
    and/or last line, each also with every "*" removed."""
    lines = response.split("\n")
    first = "\n".join(lines[1:]).strip()
    last = "\n".join(lines[:-1]).strip()
    both = "\n".join(lines[1:-1]).strip()
    return [response, response.replace("*", ""), first, last, both,
            first.replace("*", ""), last.replace("*", ""), both.replace("*", "")]  # fmt: skip


def follows(response: str, instruction_ids: list[str], kwargs: list[dict], *,
            loose: bool = False) -> list[bool]:  # fmt: skip
    """Whether `response` follows each instruction (IFEval's strict or loose test).

    Args:
        response: the model's completion text.
        instruction_ids: a row's `instruction_id_list` (every id in `CHECKERS`).
        kwargs: a row's `kwargs`, one dict per id; None values (the Hub copy fills every key)
            are dropped.
    Returns:
        One bool per instruction. An empty (whitespace) response follows nothing, as in
        `evaluation_lib.py`; loose: followed by any of the 8 `_loose_variants`.
    Raises:
        KeyError: an id not in `CHECKERS`; TypeError: kwargs a checker does not take.
    """
    candidates = _loose_variants(response) if loose else [response]
    out = []
    for iid, kw in zip(instruction_ids, kwargs, strict=True):
        check = CHECKERS[iid]
        kw = {k: v for k, v in (kw or {}).items() if v is not None}
        out.append(any(r.strip() and check(r, **kw) for r in candidates))
    return out
