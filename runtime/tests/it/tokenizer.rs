//! The tokenizer rebuilt from GGUF metadata, and the chat template from the model's metadata.

use crate::common;

use ferrite_runtime::model::{self, ChatMessage, LoadOptions, LoadedModel};

fn model() -> LoadedModel {
    model::load(&common::default_model(), &LoadOptions::default()).expect("load")
}

#[test]
fn round_trips_mixed_text_exactly() {
    let m = model();
    let texts = [
        "fn main() {\n    let x: Vec<u32> = (0..10).collect();\n\tprintln!(\"{x:?}\");\n}\n",
        "Pi is 3.14159265358979, and 2^64 = 18446744073709551616.",
        "Emoji: 🦀🚀👩‍👩‍👧 and accents: café, naïve, Zürich, 東京, Привет",
        "  leading and trailing spaces  \n\n\r\n",
        "",
    ];
    for t in texts {
        let ids = m.tokenizer.encode(t, false).expect("encode");
        assert_eq!(
            m.tokenizer.decode(&ids, false).expect("decode"),
            t,
            "round trip of {t:?}"
        );
    }
}

#[test]
fn digits_are_split_individually_like_the_reference_tokenizer() {
    let m = model();
    let ids = m.tokenizer.encode("12345", false).expect("encode");
    assert_eq!(
        ids.len(),
        5,
        "SmolLM's pre-tokenizer splits digits: {ids:?}"
    );
    // "Hello world" is two tokens in SmolLM2's vocabulary.
    let ids = m.tokenizer.encode("Hello world", false).expect("encode");
    let toks: Vec<String> = ids
        .iter()
        .map(|&i| m.tokenizer.id_to_token(i).expect("tok"))
        .collect();
    assert_eq!(toks, vec!["Hello", "Ġworld"]);
}

#[test]
fn special_tokens_map_to_their_ids_and_can_be_skipped() {
    let m = model();
    assert_eq!(m.tokenizer.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(m.tokenizer.token_to_id("<|im_end|>"), Some(2));
    // The GGUF's EOS, then `<|endoftext|>`: an end-of-turn token llama.cpp stops on too.
    assert_eq!(m.eos_token_ids, vec![2, 0]);
    let ids = m
        .tokenizer
        .encode("<|im_start|>user\nhi<|im_end|>", false)
        .expect("encode");
    assert_eq!(ids.first(), Some(&1));
    assert_eq!(ids.last(), Some(&2));
    assert!(ids.len() <= 5, "special tokens must not be split: {ids:?}");
    assert_eq!(m.tokenizer.decode(&ids, true).expect("decode"), "user\nhi");
    assert_eq!(
        m.tokenizer.decode(&ids, false).expect("decode"),
        "<|im_start|>user\nhi<|im_end|>"
    );
}

#[test]
fn chat_template_renders_a_two_turn_conversation() {
    let m = model();
    let t = m
        .chat_template
        .as_ref()
        .expect("the GGUF carries a chat template");
    let msgs = vec![
        ChatMessage {
            role: "user".into(),
            content: "What is 2+2?".into(),
            ..Default::default()
        },
        ChatMessage {
            role: "assistant".into(),
            content: "4".into(),
            ..Default::default()
        },
        ChatMessage {
            role: "user".into(),
            content: "And 3+3?".into(),
            ..Default::default()
        },
    ];
    let out = t.render(&msgs, true).expect("render");
    assert_eq!(
        out,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nWhat is 2+2?<|im_end|>\n\
         <|im_start|>assistant\n4<|im_end|>\n\
         <|im_start|>user\nAnd 3+3?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    // An explicit system message replaces the default one; no generation prompt when asked.
    let msgs = vec![
        ChatMessage {
            role: "system".into(),
            content: "Be terse.".into(),
            ..Default::default()
        },
        ChatMessage {
            role: "user".into(),
            content: "Hi".into(),
            ..Default::default()
        },
    ];
    assert_eq!(
        t.render(&msgs, false).expect("render"),
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    );
}

#[test]
fn chat_templates_get_python_string_methods_and_raise_exception() {
    let t = ferrite_runtime::model::ChatTemplate::new(
        "{% for m in messages %}{% if m.role not in ['user'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}{{ bos_token }}{{ m.content.strip().upper() }}{% endfor %}",
        "<s>".into(),
        "</s>".into(),
    )
    .expect("compile");
    let ok = vec![ChatMessage {
        role: "user".into(),
        content: "  hi  ".into(),
        ..Default::default()
    }];
    assert_eq!(t.render(&ok, false).expect("render"), "<s>HI");
    let bad = vec![ChatMessage {
        role: "tool".into(),
        content: "x".into(),
        ..Default::default()
    }];
    let e = t.render(&bad, false).expect_err("raise_exception");
    assert!(e.to_string().contains("bad role tool"), "{e}");
    let e = ferrite_runtime::model::ChatTemplate::new("{% for %}", String::new(), String::new())
        .expect_err("syntax error");
    assert!(e.to_string().contains("does not compile"), "{e}");
}
