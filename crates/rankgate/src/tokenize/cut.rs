//! Where a prompt's text may be cut without changing the engine's tokens before the cut.
//!
//! A cut at byte `c` is exact when the tokens of `text[..c]` are the first tokens of `text`, and
//! the tokens of `text[c..]` the rest. Two kinds are exact here:
//! - the start of an added token written in the text (`</s>`, `<|im_end|>`...) that is matched
//!   on the raw text (not normalized, no left strip, no word rule): `tokenizers` splits the text
//!   at added tokens before normalizing or pre-tokenizing, so each side is tokenized on its own;
//! - for byte-level BPE tokenizers (a ByteLevel pre-tokenizer with GPT-2's regex, no prefix
//!   space, no normalizer or a Unicode normal form), between an ASCII letter and a space that an
//!   ASCII letter follows: NFC/NFKC never join ASCII to a neighbour, GPT-2's regex has no
//!   look-behind and ends a letter run at the space whatever follows, and BPE merges only
//!   inside a pre-token.
//!
//! Other tokenizers (Metaspace/SentencePiece, Llama 3's split regex) get the first kind only.

/// The cut points a tokenizer allows.
#[derive(Debug, Clone, Default)]
pub struct Cuts {
    /// Added tokens the text may be cut before.
    tokens: Vec<String>,
    /// Whether letter-space-letter cuts are exact (byte-level BPE).
    pub words: bool,
}

impl Cuts {
    pub fn new(tokenizer: &tokenizers::Tokenizer, tokenizer_json: &[u8]) -> Cuts {
        let tokens = tokenizer
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| !t.normalized && !t.lstrip && !t.single_word && !t.content.is_empty())
            .map(|t| t.content)
            .collect();
        Cuts {
            tokens,
            words: byte_level_words(tokenizer_json),
        }
    }

    /// The end of `text` if it is at most `max` bytes, else the last exact cut at or before
    /// `max` (0 when there is none).
    pub fn cut(&self, text: &str, max: usize) -> usize {
        if text.len() <= max {
            return text.len();
        }
        let longest = self.tokens.iter().map(String::len).max().unwrap_or(0);
        let occurrences = self.occurrences(text, max + longest);
        let mut best = occurrences
            .iter()
            .map(|&(start, _)| start)
            .filter(|&start| start <= max)
            .max()
            .unwrap_or(0);
        if self.words {
            let bytes = text.as_bytes();
            let mut at = max;
            while at > best {
                if word_cut(bytes, at) && !inside(&occurrences, at) {
                    best = at;
                    break;
                }
                at -= 1;
            }
        }
        best
    }

    /// Exact cuts that split `text` into pieces of about `every` bytes: for each piece, the
    /// first exact cut at or after `every` bytes from its start. The choice depends only on the
    /// text up to a byte past the cut, so a text that extends another (the next turn of a chat)
    /// is cut at the same points within their common part.
    pub fn chunks(&self, text: &str, every: usize) -> Vec<usize> {
        let mut points = Vec::new();
        if text.len() <= every || every == 0 {
            return points;
        }
        let occurrences = self.occurrences(text, text.len());
        let bytes = text.as_bytes();
        let mut next_token = occurrences.iter().map(|&(start, _)| start).peekable();
        let mut from = 0;
        loop {
            let target = from + every;
            if target >= text.len() {
                return points;
            }
            while next_token.next_if(|&start| start < target).is_some() {}
            let token_cut = next_token.peek().copied();
            let mut point = token_cut;
            if self.words {
                let limit = token_cut.unwrap_or(text.len());
                point = (target..limit)
                    .find(|&at| word_cut(bytes, at) && !inside(&occurrences, at))
                    .or(token_cut);
            }
            match point {
                Some(at) if at > from && at < text.len() => {
                    points.push(at);
                    from = at;
                }
                _ => return points,
            }
        }
    }

    /// Where the added tokens occur in `text[..limit]`, as the tokenizer matches them
    /// (leftmost, then longest): (start, end) byte ranges, in order.
    fn occurrences(&self, text: &str, limit: usize) -> Vec<(usize, usize)> {
        let mut end = limit.min(text.len());
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let scope = &text[..end];
        let mut all: Vec<(usize, usize)> = self
            .tokens
            .iter()
            .flat_map(|t| {
                scope
                    .match_indices(t.as_str())
                    .map(|(s, m)| (s, s + m.len()))
            })
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        let mut kept: Vec<(usize, usize)> = Vec::new();
        for (start, end) in all {
            if kept.last().is_none_or(|&(_, last_end)| start >= last_end) {
                kept.push((start, end));
            }
        }
        kept
    }
}

/// An ASCII letter, then at `at` a space, then an ASCII letter.
fn word_cut(bytes: &[u8], at: usize) -> bool {
    at >= 1
        && bytes.get(at) == Some(&b' ')
        && bytes[at - 1].is_ascii_alphabetic()
        && bytes.get(at + 1).is_some_and(u8::is_ascii_alphabetic)
}

fn inside(occurrences: &[(usize, usize)], at: usize) -> bool {
    occurrences.iter().any(|&(s, e)| s < at && at < e)
}

/// Whether tokenizer.json's pipeline makes the letter-space-letter cut exact (module doc).
fn byte_level_words(tokenizer_json: &[u8]) -> bool {
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(tokenizer_json) else {
        return false;
    };
    let kind = |v: &serde_json::Value| v.get("type").and_then(|t| t.as_str()).map(str::to_owned);
    let pre = &json["pre_tokenizer"];
    let byte_level = kind(pre).as_deref() == Some("ByteLevel")
        && pre.get("use_regex").and_then(|v| v.as_bool()) != Some(false)
        && pre.get("add_prefix_space").and_then(|v| v.as_bool()) != Some(true);
    let normalizer_ok = match &json["normalizer"] {
        serde_json::Value::Null => true,
        n => matches!(kind(n).as_deref(), Some("NFC" | "NFKC" | "NFD" | "NFKD")),
    };
    let bpe = kind(&json["model"]).as_deref() == Some("BPE");
    byte_level && normalizer_ok && bpe
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The fixture model's tokenizer (byte-level BPE, NFC, added tokens `<s>`, `</s>`...).
    fn fixture() -> (tokenizers::Tokenizer, Cuts) {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/vllm-0.32-kv-events/tokenizer.json");
        let bytes = std::fs::read(path).expect("fixture tokenizer.json");
        let tokenizer = tokenizers::Tokenizer::from_bytes(&bytes).expect("tokenizer");
        let cuts = Cuts::new(&tokenizer, &bytes);
        (tokenizer, cuts)
    }

    fn ids(tokenizer: &tokenizers::Tokenizer, text: &str) -> Vec<u32> {
        tokenizer
            .encode_fast(text, false)
            .expect("encode")
            .get_ids()
            .to_vec()
    }

    /// Text built from pieces that stress the cuts: words, runs of spaces and newlines,
    /// punctuation, digits, combining accents (NFC composes them), non-ASCII letters, special
    /// tokens and pieces of them.
    fn text() -> impl Strategy<Value = String> {
        let piece = prop::sample::select(vec![
            "alpha", "beta", "router", "x", " ", "  ", "\n", " \n ", "\t", ".", ",", "'s", "'ll",
            "42", "1234567", "e\u{301}", "\u{301}", "é", "日本", "ü", "<s>", "</s>", "</", "s>",
            "<|user|>", "<pad>", "<unk>", "!?", "--",
        ]);
        prop::collection::vec(piece, 0..80).prop_map(|pieces| pieces.concat())
    }

    #[test]
    fn the_fixture_allows_word_cuts() {
        let (_, cuts) = fixture();
        assert!(cuts.words);
        assert!(cuts.tokens.iter().any(|t| t == "</s>"));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn a_cut_keeps_the_leading_tokens(text in text(), max in 0usize..400) {
            let (tokenizer, cuts) = fixture();
            let full = ids(&tokenizer, &text);
            let end = cuts.cut(&text, max);
            prop_assert!(end <= text.len() && (end <= max || end == text.len()));
            let head = ids(&tokenizer, &text[..end]);
            prop_assert_eq!(&full[..head.len()], &head[..]);
            // And the rest tokenized alone is the rest of the ids.
            let tail = ids(&tokenizer, &text[end..]);
            prop_assert_eq!(&full[head.len()..], &tail[..]);
        }

        #[test]
        fn pieces_concatenate_to_the_whole(text in text(), every in 1usize..64) {
            let (tokenizer, cuts) = fixture();
            let full = ids(&tokenizer, &text);
            let mut joined = Vec::new();
            let mut from = 0;
            for end in cuts.chunks(&text, every).into_iter().chain([text.len()]) {
                prop_assert!(end > from || text.is_empty());
                joined.extend(ids(&tokenizer, &text[from..end]));
                from = end;
            }
            prop_assert_eq!(joined, full);
        }

        #[test]
        fn an_extended_text_is_cut_at_the_same_points(a in text(), b in text(), every in 1usize..64) {
            let (_, cuts) = fixture();
            let longer = format!("{a}{b}");
            let short = cuts.chunks(&a, every);
            let long = cuts.chunks(&longer, every);
            // Every point of the shorter text that has a byte after it in the shorter text
            // (the cut looks one byte ahead) is a point of the longer one, in order.
            let stable: Vec<usize> = short.into_iter().filter(|&p| p + 1 < a.len()).collect();
            prop_assert_eq!(&long[..stable.len().min(long.len())], &stable[..]);
        }
    }
}
