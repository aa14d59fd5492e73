//! Structured outputs over the default model's real vocabulary: the token bytes the grammar
//! engine sees, and guides that allow exactly their grammar's texts.

use crate::common;

use ferrite_runtime::engine::{GrammarSpec, Grammars, Guide};
use ferrite_runtime::model::Tokenizer;
use serde_json::json;

fn tokenizer() -> Tokenizer {
    let path = common::default_model();
    let mut f = std::fs::File::open(&path).expect("open model");
    let content = candle_core::quantized::gguf_file::Content::read(&mut f).expect("gguf");
    Tokenizer::from_gguf(&content.metadata).expect("tokenizer")
}

fn grammars(tok: &Tokenizer) -> Grammars {
    Grammars::new(tok, tok.vocab_size(), tok.eos_token_ids()).expect("grammars")
}

/// Drives `guide` with a deterministic pseudo-random choice among the allowed tokens (a
/// stand-in for a model that tries everything), up to `max` tokens; returns the text and
/// whether the grammar finished.
fn wander(tok: &Tokenizer, guide: &mut Guide, seed: u64, max: usize) -> (String, bool) {
    let eos = tok.eos_token_ids().to_vec();
    let mut out = Vec::new();
    let mut state = seed;
    for _ in 0..max {
        let mask = guide.mask().expect("mask");
        let allowed: Vec<u32> = (0..tok.vocab_size() as u32)
            .filter(|&t| mask.is_allowed(t))
            .collect();
        assert!(!allowed.is_empty());
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let t = allowed[(state >> 33) as usize % allowed.len()];
        if eos.contains(&t) {
            return (tok.decode(&out, false).expect("decode"), true);
        }
        guide.accept(t).expect("accept");
        out.push(t);
        if guide.is_finished() {
            return (tok.decode(&out, false).expect("decode"), true);
        }
    }
    (tok.decode(&out, false).expect("decode"), false)
}

#[test]
fn token_bytes_spell_each_token_as_the_decoder_does() {
    let tok = tokenizer();
    let words = tok.token_bytes().expect("bytes");
    assert_eq!(words.len(), tok.vocab_size());
    let mut checked = 0;
    for (id, w) in words.iter().enumerate() {
        let id = id as u32;
        if w.first() == Some(&0xFF) {
            // Special: the marker, then the token's text.
            let text = tok.id_to_token(id).expect("special token");
            assert_eq!(&w[1..], text.as_bytes(), "special token {id}");
            continue;
        }
        if let Ok(text) = std::str::from_utf8(w) {
            assert_eq!(
                tok.decode(&[id], false).expect("decode"),
                text,
                "token {id}"
            );
            checked += 1;
        }
    }
    assert!(checked > 40_000, "only {checked} tokens checked");
    // The chat markers are special, so no generated text can spell them.
    let im_end = tok.token_to_id("<|im_end|>").expect("im_end");
    assert_eq!(words[im_end as usize][0], 0xFF);
}

#[test]
fn a_guide_allows_exactly_its_grammars_texts() {
    let tok = tokenizer();
    let g = grammars(&tok);
    let walk = |spec: &GrammarSpec, text: &str| -> Result<bool, String> {
        let mut guide = g.compile(spec).map_err(|e| e.to_string())?;
        for t in tok.encode(text, false).expect("encode") {
            if !guide.mask().map_err(|e| e.to_string())?.is_allowed(t) {
                return Err(format!("token {t} of {text:?} refused"));
            }
            guide.accept(t).map_err(|e| e.to_string())?;
        }
        let eos = tok.eos_token_ids()[0];
        Ok(guide.is_finished() || guide.mask().map_err(|e| e.to_string())?.is_allowed(eos))
    };
    let phone = GrammarSpec::Regex(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}".into());
    assert_eq!(walk(&phone, "(555) 123-4567"), Ok(true));
    assert_eq!(walk(&phone, "(555) 123-45"), Ok(false), "incomplete");
    assert!(walk(&phone, "555-123-4567").is_err());
    let choice = GrammarSpec::Choice(vec!["yes".into(), "no".into()]);
    assert_eq!(walk(&choice, "no"), Ok(true));
    assert!(walk(&choice, "maybe").is_err());
    let schema = GrammarSpec::JsonSchema(json!({
        "type": "object",
        "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 3}},
        "required": ["n", "s"],
        "additionalProperties": false
    }));
    assert_eq!(walk(&schema, r#"{"n": 12, "s": "abc"}"#), Ok(true));
    assert!(walk(&schema, r#"{"n": 12, "s": "abcd"}"#).is_err());
    assert!(walk(&schema, r#"{"n": "12"}"#).is_err());
    assert!(walk(&GrammarSpec::JsonObject, r#"[1]"#).is_err());
    assert_eq!(
        walk(&GrammarSpec::JsonObject, r#"{"a": [1, {"b": null}]}"#),
        Ok(true)
    );
}

#[test]
fn any_path_through_a_schema_is_valid_json_of_it() {
    let tok = tokenizer();
    let g = grammars(&tok);
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"enum": ["Paris", "Tokyo", "Lima"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}
        },
        "required": ["name", "age", "city", "tags"],
        "additionalProperties": false
    });
    let spec = GrammarSpec::JsonSchema(schema);
    for seed in 0..8 {
        let mut guide = g.compile(&spec).expect("compile");
        let (text, done) = wander(&tok, &mut guide, seed, 400);
        assert!(done, "seed {seed}: not finished in 400 tokens: {text:?}");
        let v: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
        let age = v["age"].as_i64().expect("age");
        assert!((0..=120).contains(&age), "{text}");
        assert!(v["name"].as_str().expect("name").chars().count() <= 12);
        assert!(["Paris", "Tokyo", "Lima"].contains(&v["city"].as_str().expect("city")));
        assert!(v["tags"].as_array().expect("tags").len() <= 3);
        assert_eq!(v.as_object().expect("object").len(), 4, "{text}");
    }
}
