//! The client APIs kvroute reads bodies of, one per path: where each is
//! forwarded, how its body is parsed for routing, which conventions its
//! answers and errors follow, and whether a disaggregated fleet splits it.

use kvroute_prompt::body::{self, RoutingRequest};

use crate::dialect::Dialect;

/// Which OpenAI endpoint a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
    /// SGLang's native `/generate`.
    Generate,
    /// OpenAI's Responses API.
    Responses,
    /// Anthropic's Messages API.
    Messages,
}

impl Endpoint {
    /// The path forwarded to the worker.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Generate => "/generate",
            Endpoint::Responses => "/v1/responses",
            Endpoint::Messages => "/v1/messages",
        }
    }

    /// The endpoint a request path names (as a gateway passes it on, with
    /// any prefix before `/v1`), if kvroute reads its body.
    pub fn of_path(path: &str) -> Option<Endpoint> {
        let path = path.split('?').next().unwrap_or(path).trim_end_matches('/');
        [
            Endpoint::Chat,
            Endpoint::Completions,
            Endpoint::Responses,
            Endpoint::Messages,
            Endpoint::Generate,
        ]
        .into_iter()
        .find(|e| path.ends_with(e.path()))
    }

    /// Reads a body sent to this endpoint for routing.
    pub fn parse(self, body: &[u8]) -> Result<RoutingRequest, body::ParseError> {
        match self {
            Endpoint::Generate => kvroute_prompt::generate::parse_generate(body),
            Endpoint::Responses => kvroute_prompt::responses::parse_responses(body),
            Endpoint::Messages => kvroute_prompt::messages::parse_messages(body),
            Endpoint::Completions | Endpoint::Chat => {
                body::parse_request(body, self == Endpoint::Chat)
            }
        }
    }

    /// The API conventions its answers and errors follow.
    pub fn dialect(self) -> Dialect {
        match self {
            Endpoint::Completions | Endpoint::Chat | Endpoint::Generate => Dialect::OpenAi,
            Endpoint::Responses => Dialect::Responses,
            Endpoint::Messages => Dialect::Anthropic,
        }
    }

    /// Whether a disaggregated fleet splits its requests: the Responses
    /// and Messages APIs are served whole, by a rank that decodes.
    pub fn splits(self) -> bool {
        matches!(
            self,
            Endpoint::Completions | Endpoint::Chat | Endpoint::Generate
        )
    }
}
