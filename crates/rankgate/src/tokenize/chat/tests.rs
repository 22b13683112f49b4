use super::*;
use proptest::prelude::*;
use serde_json::Value as Json;
use std::sync::OnceLock;

/// The fixture model's tokenizer, with small limits so that cuts and pieces happen too.
fn fixture() -> &'static ChatTokenizer {
    static TOKENIZER: OnceLock<ChatTokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let dir =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/vllm-0.32-kv-events");
        ChatTokenizer::from_dir(&dir)
            .expect("fixture tokenizer")
            .with_limits(Limits {
                max_bytes: 300,
                max_tokens: 100,
            })
    })
}

/// JSON shaped like request bodies, and often not quite: the keys the tokenizer reads,
/// with values of any type at any depth.
fn body() -> impl Strategy<Value = Json> {
    let leaf = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::from),
        any::<i64>().prop_map(Json::from),
        any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(Json::Null, Json::Number)),
        "(\\PC|</s>|<s>| |\n){0,40}".prop_map(Json::from),
    ];
    let keys = prop::sample::select(vec![
        "messages",
        "role",
        "content",
        "type",
        "text",
        "tool_calls",
        "function",
        "arguments",
        "prompt",
        "add_generation_prompt",
        "continue_final_message",
        "tools",
        "chat_template_kwargs",
        "name",
        "add_special_tokens",
        "documents",
        "tool_call_id",
    ]);
    leaf.prop_recursive(5, 64, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Json::Array),
            prop::collection::btree_map(keys.clone(), inner, 0..6).prop_map(|map| {
                Json::Object(map.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
            }),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn any_body_is_tokens_or_an_error(body in body()) {
        let bytes = serde_json::to_vec(&body).expect("json");
        let tok = fixture();
        for tokens in [tok.chat(&bytes), tok.completion(&bytes)].into_iter().flatten() {
            prop_assert!(tokens.ids.len() <= 100);
        }
    }

    #[test]
    fn capped_and_cached_ids_lead_the_whole_prompts(
        contents in prop::collection::vec("(\\PC|</s>|<s>| |  |\n|e\u{301}){0,80}", 1..8),
    ) {
        static WHOLE: OnceLock<ChatTokenizer> = OnceLock::new();
        let whole = WHOLE.get_or_init(|| {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/fixtures/vllm-0.32-kv-events");
            ChatTokenizer::from_dir(&dir).expect("fixture tokenizer").with_cache(0)
        });
        let messages: Vec<Json> = contents
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                serde_json::json!({"role": role, "content": c})
            })
            .collect();
        let bytes = serde_json::to_vec(&serde_json::json!({"messages": messages})).expect("json");
        let full = whole.chat(&bytes).expect("whole").ids;
        let capped = fixture().chat(&bytes).expect("capped").ids;
        prop_assert_eq!(&full[..capped.len()], &capped[..]);
    }

    #[test]
    fn any_bytes_are_tokens_or_an_error(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let tok = fixture();
        let _ = tok.chat(&bytes);
        let _ = tok.completion(&bytes);
    }
}
