"""Sphinx extension for the Chinese edition: queries are segmented the way the index was.

Sphinx's Chinese index is built with jieba (``book/_tools/zh_edition.py`` gives it
the glossary's terms as a user dictionary), so it holds words: 归一化, 训练, 模式.
In the browser, though, Sphinx splits a query only at spaces and punctuation, so
a phrase such as 训练模式 or 归一化层 is looked up as one word, is not in the
index, and finds nothing. Here the query's runs of Chinese characters are cut
into the words the index holds, longest first from the left (forward maximum
matching, the classic way to segment Chinese by a dictionary), by the index's own vocabulary
(its terms and title terms: every word jieba produced from the book), which is
the dictionary the index was segmented with, restricted to the book's words. A
page then has to contain every word of the phrase, as for any multi-word query.
Characters that no indexed word covers are dropped, as jieba's one-character
words are never indexed; a run that no word covers is kept whole (it finds
nothing, as before).

A run is kept whole only when it is a word of the search dictionary (the
glossary's terms: jieba cuts those the same way everywhere). Any other run is
cut into shorter indexed words even when it is itself in the index: jieba cuts
a compound such as 训练模式 whole on one page and as 训练 + 模式 on another,
and cut_for_search indexes the shorter words of a whole one too, so the
shorter words find every page that has the phrase.
"""

from __future__ import annotations

import json
from pathlib import Path

from sphinx.search import languages
from sphinx.search.zh import SearchChinese

# Loaded by language_data.js before searchtools.js, whose default splitQuery
# steps aside when one is defined. It runs when a query is parsed, after the
# index has loaded (Search._index); before that it splits as the default does.
SPLITTER = r"""
function splitQuery(query) {
  const DICTIONARY = new Set(__DICTIONARY__);
  const HAN = /\p{Script=Han}/u;
  const words = query.split(/[^\p{Letter}\p{Number}_\p{Emoji_Presentation}]+/gu).filter((t) => t);
  const index = typeof Search !== "undefined" && Search._index ? Search._index : null;
  const known = (w) => index.terms.hasOwnProperty(w) || index.titleterms.hasOwnProperty(w);
  const out = [];
  for (const word of words) {
    for (const piece of word.match(/\p{Script=Han}+|[^\p{Script=Han}]+/gu)) {
      if (!index || !HAN.test(piece) || piece.length < 2 || DICTIONARY.has(piece)) {
        out.push(piece);
        continue;
      }
      // forward maximum matching: at each position the longest indexed word (2 to 12 characters,
      // shorter than the run), or one character skipped where none starts
      const cut = [];
      for (let i = 0; i < piece.length; ) {
        let len = Math.min(12, piece.length - i, piece.length - 1);
        while (len >= 2 && !known(piece.slice(i, i + len))) len--;
        if (len >= 2) {
          cut.push(piece.slice(i, i + len));
          i += len;
        } else {
          i += 1;
        }
      }
      out.push(...(cut.length ? cut : [piece]));
    }
  }
  return out;
}
"""


def _use(app):
    if not (app.config.language and app.config.language.startswith("zh")):
        return
    path = (app.config.html_search_options or {}).get("dict")
    words = sorted({line.split()[0] for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()}
                   if path else [])

    class SearchChineseByIndexWords(SearchChinese):
        js_splitter_code = SPLITTER.replace("__DICTIONARY__", json.dumps(words, ensure_ascii=False))

    languages["zh"] = SearchChineseByIndexWords


def setup(app):
    app.connect("builder-inited", _use)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
