"""Reading the constraints a person wrote, for the compaction plugin (issue 19, item 8).

A summary must not lose a prohibition the user stated, wherever it sits (any user message, a Steer,
a Followup, a system message) and however it is phrased. This module reads a text the way the
plugin needs it, without a model:

* :func:`read` splits a text into sentences (list blocks under a ``Header:`` line stay one unit;
  a line wrapped mid-sentence is joined to the next) and sorts each one:

  - a **constraint** when it holds a constraint word of a language below (never, do not,
    don't / don’t, must, must not, shall not, only, always, avoid, under no circumstances,
    forbidden, please ...; French, German, Spanish, Italian, Portuguese, Dutch and a dozen more
    Latin-script languages, Russian and Ukrainian, Greek, Chinese, Japanese, Korean, Arabic,
    Hebrew, Hindi, Thai). Case, curly quotes, full-width forms and zero-width characters do not
    matter;
  - **plain** when it holds none, in a language the reader knows (English, French, German,
    Spanish, Italian, Portuguese, Dutch, Russian / Ukrainian by their common words; Greek, Chinese,
    Japanese, Korean by script, where the negation and command forms are a closed set);
  - **unread** otherwise: a script or a language the reader has no list for. The plugin keeps
    a message with an unread sentence whole, word for word, rather than trust a summary with it.

  The reader errs towards constraints: a plain sentence read as one costs the tokens of that
  sentence in every later summary, a constraint read as plain would be lost.
* :func:`fold` / :func:`key`: the comparison form of a text (NFKC, quotes and dashes made
  straight, zero-width characters removed, case folded, whitespace collapsed; :func:`key` also
  drops trailing full stops), so ``Don’t`` and ``DON'T`` compare equal.

Only the standard library; nothing here knows about messages.
"""

from __future__ import annotations

import functools
import re
import unicodedata

from attrs import frozen

__all__ = ["Reading", "fold", "holds", "key", "read"]


# -- the comparison form -------------------------------------------------------------------------

_QUOTES = str.maketrans({
    **dict.fromkeys("\u2018\u2019\u201a\u201b\u2032\u02bc\uff07`\u00b4", "'"),
    **dict.fromkeys("\u201c\u201d\u201e\u201f\u2033\u00ab\u00bb\uff02", '"'),
    **dict.fromkeys("\u2010\u2011\u2012\u2013\u2014\u2015\u2212", "-"),
    **dict.fromkeys("\u200b\u200c\u200d\u2060\ufeff\u00ad", None),
})


def fold(text: str) -> str:
    """``text`` in the form compared: NFKC, straight quotes and dashes, no zero-width characters,
    case folded, runs of whitespace as one space, stripped."""
    return " ".join(unicodedata.normalize("NFKC", text).translate(_QUOTES).casefold().split())


_TRAILING = re.compile(r"[\s.!?;:,\u3002\uff01\uff1f\uff1b\uff1a\u2026]+$")


def key(item: str) -> str:
    """The form an item is looked for in: :func:`fold` without trailing full stops (``.``, ``!``,
    ``?``, ``;``, ``:``, ``…`` and their CJK forms)."""
    return _TRAILING.sub("", fold(item))


def holds(folded: str, item: str) -> bool:
    """Whether ``folded`` (a text through :func:`fold`) holds ``item`` (any text), compared as
    :func:`key` forms; an item that is empty in that form is held by anything."""
    k = key(item)
    return not k or k in folded


# -- constraint words ----------------------------------------------------------------------------

def _words(*groups: str) -> str:
    return "|".join(w for g in groups for w in g.split())


# whole words (or phrases, "_" standing for a space), compared on the folded text
_WORDS = _words(
    # English
    "never not no none nothing nobody nowhere neither nor cannot without except unless instead only solely "
    "exclusively always must mustnt shall shant should shouldnt ought dont doesnt didnt cant wont isnt arent "
    "alone please pls plz kindly careful carefully caution warning important importantly critical crucial "
    "essential mandatory obligatory ensure strictly limit limits max maximum minimum forbade ban bans banned "
    "banning quit quits quitting leave untouched unchanged intact preserve retain read-only readonly skip exclude "
    "ignore approval approve permission confirm confirmation no-go as_is ask_me ask_first hold_off "
    "make_sure be_sure rather_than need_to needs_to have_to has_to at_all_costs at_most at_least off_limits "
    "off-limits out_of_bounds hands_off stick_to stay_away stay_out stay_off stay_within stay_inside stay_clear "
    "keep_away keep_out keep_off keep_clear keep_within keep_to by_no_means no_matter_what",
    # French
    "ne jamais pas aucun aucune rien nul nulle surtout uniquement seulement exclusivement toujours doit dois "
    "doivent devez devons faut sans sauf veuillez prière absolument strictement s'il_vous_plaît s'il_te_plaît "
    "merci_de laisse laissez tel_quel telle_quelle",
    # German
    "nie niemals nimmer nicht nichts kein keine keinen keinem keiner keines keinesfalls keineswegs nur immer "
    "stets ohne ausser bitte ausschliesslich lediglich unbedingt achtung wichtig lass lasse lassen unverändert "
    "unangetastet",
    # Spanish
    "nunca jamás jamas ningún ninguna ninguno nada nadie ni solo sólo solamente únicamente unicamente siempre "
    "debe debes deben debemos debería deberías sin salvo excepto cuidado tienes_que tiene_que hay_que por_favor "
    "deja dejá deje intacta intacto tal_cual",
    # Italian
    "non mai nessun nessuno nessuna niente nulla né soltanto sempre deve devi devono dovete bisogna senza tranne "
    "assolutamente attenzione importante per_favore per_piacere lascia lasci intatta intatto",
    # Portuguese
    "não nao nenhum nenhuma ninguém nem só somente apenas devem deves precisa sem exceto tem_que tens_que deixe "
    "deixa intacta",
    # Dutch
    "niet nooit geen niets nergens alleen slechts uitsluitend altijd moet moeten mag mogen zonder behalve "
    "alsjeblieft alstublieft graag beslist zorg_dat zorg_ervoor laat ongewijzigd",
    # Polish, Czech / Slovak, Swedish, Norwegian / Danish, Finnish, Turkish, Indonesian / Malay,
    # Vietnamese, Romanian, Hungarian, Tagalog, Swahili
    "nigdy tylko zawsze musisz musicie proszę prosze nikdy nesmí nesmíte nesmíš pouze jen vždy musíte musíš "
    "prosím inte aldrig ej bara endast alltid måste ikke aldri forbudt unngå undgå kun altid älä älkää ei "
    "koskaan kielletty vältä vain aina täytyy pitää asla hiç hiçbir sadece yalnızca lütfen jangan tidak "
    "dilarang hindari hanya selalu harus tolong mohon không đừng cấm chớ tránh chỉ luôn phải nu niciodată "
    "doar numai mereu întotdeauna trebuie soha sose tilos csak mindig kell kérem huwag hindi bawal kamwe "
    "marufuku",
    # Russian, Ukrainian, Bulgarian, Serbian
    "не ни нет нельзя никогда никак ничего только всегда надо нужно следует пожалуйста прошу ні ніколи лише "
    "тільки завжди треба потрібно никога само винаги никада увек немој немојте",
    # Greek
    "μη μην δεν όχι ποτέ ουδέποτε μόνο πάντα πρέπει παρακαλώ",
    # Arabic, Hebrew
    "لا لن لم ليس ولا أبدا أبداً ابدا إياك فقط دائما دائماً يجب رجاء من_فضلك "
    "אל לא אסור אין לעולם רק תמיד חייב חייבים בבקשה",
)
# word beginnings: forbid → forbidden, forbids ...
_STEMS = _words(
    "forbid prohibit disallow refrain abstain avoid restrict require stop cease taboo barred rule constraint",
    "interdi défend prohib évit obligatoire impérati",
    "verbot verbiet untersag vermeid unterlass muss müss musst darf dürf soll pflicht beacht",
    "evit obligatori vietat proibit obbligatori proibid vedad obrigatóri verbod verbied vermijd",
    "zakaz zabroni unika zákaz zakázán förbjud undvik yasak kaçın larang interzis kerül",
    "запрещ запрет избега избег долж обязательн заборон",
    "απαγορ αποφυγ απόφυγ αποφεύγ",
    "ممنوع يمنع يحظر محظور تجنب הימנע",
)
# anywhere (scripts without spaces between words)
_ANYWHERE = (
    # Chinese
    "不没沒别別勿禁莫未非无無免止只仅僅必须須务務切绝絕决決请請要应應该該得准许許限严嚴避戒休"
)
_SUBSTRINGS = _words(
    "总是 總是 始终 始終 永远 永遠 一定 千万 千萬",
    # Japanese
    "ない なく なかっ ません ぬ ず 絶対 決して けっして 二度と やめ 止め 避け 控え ダメ だめ 駄目 いけ なら 必ず "
    "常に いつも のみ だけ しか ください 下さい ほしい 欲しい こと べき 以外 無断 勝手 注意 お願い",
    # Korean
    "마세요 마십시오 마라 말아 말고 말_것 말것 지_마 지마 않 안_돼 안돼 안_되 안되 못 금지 금물 절대 결코 반드시 꼭 "
    "항상 언제나 피하 삼가 없이 주세요 주십시오 바랍니다 십시오 세요 만",
    # Thai
    "อย่า ห้าม ไม่ เท่านั้น เสมอ ต้อง กรุณา โปรด",
)
_INDIC = _words("मत नहीं नही कभी वर्जित मना निषेध केवल सिर्फ सिर्फ़ हमेशा ज़रूर जरूर अवश्य कृपया न")


def _alternatives(words: str) -> str:
    return "|".join(re.escape(w.replace("_", " ")) for w in sorted(set(words.split("|")), key=len, reverse=True))


_MARKER = re.compile(
    rf"(?<!\w)(?:{_alternatives(_WORDS)})(?!\w)"         # whole words
    rf"|(?<!\w)(?:{_alternatives(_STEMS)})"              # word beginnings
    r"|n't(?!\w)|(?<!\w)n'(?=\w)"                        # English don't, can't ...; French n'utilisez
    rf"|[{_ANYWHERE}]|{_alternatives(_SUBSTRINGS)}"      # CJK, kana, hangul, Thai
    r"|な(?=[\s。！!」』]|$)"                             # Japanese prohibitive: するな
    rf"|(?<![\u0900-\u097f])(?:{_alternatives(_INDIC)})(?![\u0900-\u097f])",  # Hindi (marks are not \w)
)


# -- knowing the language ----------------------------------------------------------------------

def _set(text: str) -> frozenset[str]:
    return frozenset(text.split())


_COMMON: tuple[frozenset[str], ...] = (
    _set(  # English: function words and the commonest verbs of a chat with an agent
        "a an the and or but if then so of to in on at by for from with as into onto about after before over "
        "under up down out off than that this these those there here it its is are was were be been being am "
        "do does did done have has had having i me my mine we us our you your yours he him his she her they "
        "them their what which who whom whose why how where when all any each every some more most other such "
        "own same too very can will would could may might just also now next again once yes ok okay thanks "
        "thank go going get got make made see look check read run use find fix add show tell try write open "
        "start continue proceed finish let please well good fine great sure right one two first last new old "
        "file files result results test tests code answer question report part items task work done"),
    _set(  # French
        "le la les un une des de du et est en que qui dans pour sur avec ce cette ces il elle ils elles nous "
        "vous je tu au aux se sa son ses mais ou par plus à été être avoir fait comme tout tous leur"),
    _set(  # German
        "der die das den dem des und ist ein eine einen einem einer zu mit von auf für im in es sie wir ich du "
        "auch sich bei nach aus wie wenn oder aber dass wird werden sind war hat haben noch schon dann"),
    _set(  # Spanish
        "el la los las un una unos unas y es en de del que por para con se lo su sus al como pero más este esta "
        "yo tú usted está son fue hay muy"),
    _set(  # Italian
        "il lo la gli le un una uno e è di da in che per con su del della dei delle al alla si ma come questo "
        "questa sono anche più"),
    _set(  # Portuguese
        "o a os as um uma e é de do da dos das em no na que para com por se ao mas como você eu está são foi"),
    _set(  # Dutch
        "de het een en is van op te dat die in met voor zijn er aan je ik we wij u ook als maar naar bij om dit"),
    _set(  # Russian, Ukrainian
        "и в во на с со что это по к из для а о у от как то все он она они мы вы я же бы был была есть "
        "і та що це з до від як він вона вони ми ви я є"),
)
_COMMON_SHARE = 0.3
"""A sentence is in a language when at least this share of its words are that language's common
words (prose runs at 40-60 %; one English article in a sentence of another language is not
enough)."""
_READ_BY_SCRIPT = frozenset({"GREEK", "CJK", "HIRAGANA", "KATAKANA", "HANGUL"})
"""Scripts read without a word list: their negation and command forms are a closed set (above)."""
_READ_BY_WORDS = frozenset({"LATIN", "CYRILLIC"})
_CLAUSE = re.compile(r"[:;()\[\]{}\"\uff1a\uff1b]|\s-+\s")
_WORD = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)?")


@functools.lru_cache(maxsize=4096)
def _script(ch: str) -> str:
    try:
        return unicodedata.name(ch).split(" ", 1)[0]
    except ValueError:
        return "UNKNOWN"


def _readable(folded: str) -> bool:
    """Whether a sentence without a constraint word is in a script / language the reader knows."""
    scripts = {_script(c) for c in folded if c.isalpha()}
    if not scripts:
        return True  # numbers, punctuation, symbols: nothing to read
    if scripts - _READ_BY_SCRIPT - _READ_BY_WORDS:
        return False
    if not scripts & _READ_BY_WORDS:
        return True
    # each clause on its own: an English lead-in ("One more thing: ...") does not make the rest English
    for clause in _CLAUSE.split(folded):
        words = [w for w in _WORD.findall(clause) if _script(w[0]) in _READ_BY_WORDS]
        if len(words) < 2:
            continue  # one word: no sentence to misread
        best = max(sum(w in common for w in words) for common in _COMMON)
        if best < 1 or best < _COMMON_SHARE * len(words):
            return False
    return True


# -- sentences ---------------------------------------------------------------------------------

_BULLET = re.compile(r"^\s*(?:[-*+\u2022\u2023\u25e6\u2043\u2219\u00b7]|\d{1,3}[.)]|[a-zA-Z][.)])\s+")
_ENDS = ".!?;:\u2026\u3002\uff01\uff1f\uff1b\uff1a"
_CLOSERS = "'\"\u2019\u201d)]\u300d\u300f\uff09"
_HEADER = re.compile(r"[:\uff1a]\s*$")
_BREAK = re.compile(rf"[.!?\u2026]+[{re.escape(_CLOSERS)}]*\s+|[\u3002\uff01\uff1f]+[{re.escape(_CLOSERS)}]*\s*")
_WRAP_LINES = 4
"""At most this many lines without a full stop at their end are joined into one unit."""
_ABBREVIATIONS = frozenset(
    "e.g i.e etc vs mr mrs ms dr prof st no nr cf approx fig inc ltd jr sr z.b d.h usw bzw p.ex ex al "
    "p.s p.p.s n.b".split())


def _units(text: str) -> list[tuple[str, bool]]:
    """``(unit, is_prose)``: paragraph lines joined where a sentence wraps, and a ``Header:`` line
    with the list lines under it as one unit (not split further)."""
    units: list[tuple[list[str], bool]] = []
    for line in text.split("\n"):  # only "\n": a unit is then an exact slice of the text
        stripped = line.strip()
        if not stripped:
            units.append(([], True))  # a blank line ends the unit
            continue
        if units and units[-1][0]:
            cur, prose = units[-1]
            last = cur[-1].rstrip()
            if not prose and (_BULLET.match(line) or line[:1].isspace()):
                cur.append(line)  # a list line (or its continuation) under a header
                continue
            if prose and _HEADER.search(last) and _BULLET.match(line):
                units[-1] = (cur + [line], False)  # the header's list starts
                continue
            if prose and last[-1] not in _ENDS + _CLOSERS and not _BULLET.match(line) and len(cur) < _WRAP_LINES:
                cur.append(line)  # a sentence wrapped onto the next line (or a line without a full stop)
                continue
        units.append(([line], True))
    return [("\n".join(lines).strip(), prose) for lines, prose in units if lines]


def _sentences(unit: str) -> list[str]:
    out: list[str] = []
    start = 0
    for m in _BREAK.finditer(unit):
        end = m.end()
        if end >= len(unit):
            break
        nxt = unit[end]
        if unit[m.start()] in ".!?\u2026":  # Latin: a capital (or not a letter) follows, no abbreviation
            if nxt.islower():
                continue
            before = unit[start:m.start()].rsplit(None, 1)
            word = before[-1].casefold().strip("(\"'") if before else ""
            if unit[m.start()] == "." and (word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha())):
                continue
        piece = unit[start:m.end()].strip()
        if piece:
            out.append(piece)
        start = end
    rest = unit[start:].strip()
    if rest:
        out.append(rest)
    return out


@frozen
class Reading:
    """What :func:`read` found in a text."""

    constraints: tuple[str, ...]
    """The sentences (or ``Header:`` list blocks) holding a constraint word, verbatim, in order."""
    unread: tuple[str, ...]
    """The sentences in a script or language the reader does not know, verbatim (a text with any
    is kept whole by the compaction plugin)."""


def read(text: str) -> Reading:
    """Read ``text``'s sentences as constraints, plain text, or unread (module docstring)."""
    constraints: list[str] = []
    unread: list[str] = []
    for unit, prose in _units(text):
        for sentence in _sentences(unit) if prose else [unit]:
            folded = fold(sentence)
            if not folded:
                continue
            if _MARKER.search(folded):
                constraints.append(sentence)
            elif not _readable(folded):
                unread.append(sentence)
    return Reading(tuple(dict.fromkeys(constraints)), tuple(dict.fromkeys(unread)))
