//! Which POST paths each flavor proxies to a rank, and what kind of answer each one gets. One
//! table per flavor (plus the OpenAI paths both share) keeps the surface reviewable against the
//! engines' own route lists: vLLM's `api_server.py` with its pooling, score and Anthropic
//! routers, SGLang's `http_server.py`.

use super::SimFlavor;

/// What a proxied path asks of the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Endpoint {
    /// Decoded token by token on a rank, streaming or not.
    Decode(Api),
    /// Answered once the prompt is admitted on a rank, with no decoding.
    Pool(Pooled),
    /// Served by the API server's tokenizer: it never reaches a rank's KV.
    Tokenize,
    Detokenize,
}

/// The generation APIs, each with its own request fields and response framing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Api {
    Chat,
    Completion,
    /// OpenAI's Responses API (`/v1/responses`).
    Responses,
    /// Anthropic's Messages API (`/v1/messages`, vLLM).
    Messages,
    /// SGLang's native `/generate`.
    Generate,
}

/// The answers that need a prompt admitted but no decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pooled {
    Embedding,
    /// vLLM `/pooling`.
    Pooling,
    /// vLLM `/classify`, SGLang `/v1/classify`.
    Classify,
    /// vLLM `/score`: one `score` entry per pair.
    Score,
    /// vLLM's Jina/Cohere-style rerank: `results` with `relevance_score`.
    Rerank,
    /// vLLM's audio APIs, whose body is a multipart form.
    Transcription,
    /// SGLang `/encode` and `/classify`: an embedding with `meta_info`.
    Encode,
    /// SGLang `/v1/score`: `scores` as lists of probabilities.
    SglScore,
    /// SGLang `/v1/rerank`: a bare list of `{score, document, index}`.
    SglRerank,
}

use Api::*;
use Endpoint::*;
use Pooled::*;

const SHARED: &[(&str, Endpoint)] = &[
    ("/v1/chat/completions", Decode(Chat)),
    ("/v1/completions", Decode(Completion)),
    ("/v1/embeddings", Pool(Embedding)),
    ("/v1/responses", Decode(Responses)),
    ("/tokenize", Tokenize),
    ("/detokenize", Detokenize),
];

const VLLM: &[(&str, Endpoint)] = &[
    ("/v1/messages", Decode(Messages)),
    ("/v1/audio/transcriptions", Pool(Transcription)),
    ("/v1/audio/translations", Pool(Transcription)),
    ("/pooling", Pool(Pooling)),
    ("/classify", Pool(Classify)),
    ("/score", Pool(Score)),
    ("/v1/score", Pool(Score)),
    ("/rerank", Pool(Rerank)),
    ("/v1/rerank", Pool(Rerank)),
    ("/v2/rerank", Pool(Rerank)),
];

const SGLANG: &[(&str, Endpoint)] = &[
    ("/generate", Decode(Generate)),
    ("/encode", Pool(Encode)),
    ("/classify", Pool(Encode)),
    ("/v1/classify", Pool(Classify)),
    ("/v1/score", Pool(SglScore)),
    ("/v1/rerank", Pool(SglRerank)),
    ("/v1/tokenize", Tokenize),
    ("/v1/detokenize", Detokenize),
];

/// The endpoint a POST to `path` reaches on this flavor.
pub(super) fn route(flavor: SimFlavor, path: &str) -> Option<Endpoint> {
    let own = match flavor {
        SimFlavor::Vllm => VLLM,
        SimFlavor::Sglang => SGLANG,
    };
    SHARED
        .iter()
        .chain(own)
        .find(|(p, _)| *p == path)
        .map(|(_, e)| *e)
}

impl Endpoint {
    /// Whether the request may name a model that the engine then checks. SGLang's native
    /// endpoints and its rerank request have no `model` field: whatever is there is ignored.
    pub(super) fn checks_model(self) -> bool {
        !matches!(self, Decode(Generate) | Pool(Encode) | Pool(SglRerank))
    }

    /// Whether the body is a multipart form rather than JSON.
    pub(super) fn is_form(self) -> bool {
        self == Pool(Transcription)
    }

    /// Whether errors are answered in Anthropic's shape (`{"type": "error", "error": {..}}`),
    /// as vLLM's Messages router translates them.
    pub(super) fn anthropic_errors(self) -> bool {
        self == Decode(Messages)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_flavor_serves_its_own_paths() {
        assert_eq!(
            route(SimFlavor::Vllm, "/v1/messages"),
            Some(Decode(Messages))
        );
        assert_eq!(route(SimFlavor::Sglang, "/v1/messages"), None);
        assert_eq!(
            route(SimFlavor::Sglang, "/generate"),
            Some(Decode(Generate))
        );
        assert_eq!(route(SimFlavor::Vllm, "/generate"), None);
        assert_eq!(route(SimFlavor::Vllm, "/classify"), Some(Pool(Classify)));
        assert_eq!(route(SimFlavor::Sglang, "/classify"), Some(Pool(Encode)));
        assert_eq!(route(SimFlavor::Vllm, "/v1/rerank"), Some(Pool(Rerank)));
        assert_eq!(
            route(SimFlavor::Sglang, "/v1/rerank"),
            Some(Pool(SglRerank))
        );
        for flavor in [SimFlavor::Vllm, SimFlavor::Sglang] {
            assert_eq!(route(flavor, "/v1/responses"), Some(Decode(Responses)));
            assert_eq!(route(flavor, "/tokenize"), Some(Tokenize));
            assert_eq!(route(flavor, "/v1/models"), None);
        }
    }
}
