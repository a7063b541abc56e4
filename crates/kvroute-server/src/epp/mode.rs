//! The processing mode a stream must be in: both bodies
//! `FULL_DUPLEX_STREAMED`, as the Gateway API Inference Extension's
//! endpoint picker protocol requires.
//!
//! The picker answers a request's headers only once it has the whole body
//! (it cannot pick before it has tokenized the prompt), and answers the body
//! by streaming it back. In any other request body mode Envoy waits for the
//! headers' answer before it sends the body, and the stream deadlocks until
//! Envoy's timeout; in any other response body mode the picker would not see
//! the answer's first chunk and usage, which its load accounting and
//! accuracy need. So a stream whose `protocol_config` names another mode is
//! refused at once with `FAILED_PRECONDITION`, saying which mode to set.
//!
//! `send_body_without_waiting_for_header_response` is not required (Dynamo's
//! picker requires it): Envoy documents it as applying to `STREAMED` mode
//! only and ignored in every other, so requiring it would refuse the
//! reference Envoy configuration of llm-d, which does not set it. Envoy
//! before 1.32 sends no `protocol_config` at all; such a stream is taken on
//! trust, as Dynamo takes it.

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::ProtocolConfiguration;

/// Why a stream's processing mode is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModeError {
    /// The request body is not sent `FULL_DUPLEX_STREAMED`.
    #[error(
        "request_body_mode is {0}; the endpoint picker needs FULL_DUPLEX_STREAMED \
         (processing_mode: request_header_mode SEND, request_body_mode FULL_DUPLEX_STREAMED, \
         request_trailer_mode SEND)"
    )]
    RequestBody(String),
    /// The response body is not sent `FULL_DUPLEX_STREAMED`.
    #[error(
        "response_body_mode is {0}; the endpoint picker needs FULL_DUPLEX_STREAMED \
         (processing_mode: response_header_mode SEND, response_body_mode FULL_DUPLEX_STREAMED, \
         response_trailer_mode SEND)"
    )]
    ResponseBody(String),
}

/// The name of a body send mode as Envoy's configuration spells it.
fn mode_name(mode: i32) -> String {
    BodySendMode::try_from(mode).map_or_else(
        |_| format!("unknown mode {mode}"),
        |m| m.as_str_name().to_owned(),
    )
}

/// Checks the processing mode Envoy announced for a stream.
pub fn check(config: &ProtocolConfiguration) -> Result<(), ModeError> {
    let full_duplex = BodySendMode::FullDuplexStreamed as i32;
    if config.request_body_mode != full_duplex {
        return Err(ModeError::RequestBody(mode_name(config.request_body_mode)));
    }
    if config.response_body_mode != full_duplex {
        return Err(ModeError::ResponseBody(mode_name(
            config.response_body_mode,
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(
        request: BodySendMode,
        response: BodySendMode,
        without_waiting: bool,
    ) -> ProtocolConfiguration {
        ProtocolConfiguration {
            request_body_mode: request as i32,
            response_body_mode: response as i32,
            send_body_without_waiting_for_header_response: without_waiting,
        }
    }

    #[test]
    fn full_duplex_both_ways_is_accepted_with_or_without_the_flag() {
        let fd = BodySendMode::FullDuplexStreamed;
        assert_eq!(check(&config(fd, fd, true)), Ok(()));
        assert_eq!(check(&config(fd, fd, false)), Ok(()));
    }

    #[test]
    fn any_other_body_mode_is_refused_naming_it_and_the_mode_to_set() {
        let fd = BodySendMode::FullDuplexStreamed;
        for other in [
            BodySendMode::None,
            BodySendMode::Streamed,
            BodySendMode::Buffered,
            BodySendMode::BufferedPartial,
        ] {
            let e = check(&config(other, fd, true)).expect_err("refused");
            assert_eq!(e, ModeError::RequestBody(other.as_str_name().to_owned()));
            assert!(e
                .to_string()
                .contains("request_body_mode FULL_DUPLEX_STREAMED"));
            let e = check(&config(fd, other, true)).expect_err("refused");
            assert!(e
                .to_string()
                .starts_with(&format!("response_body_mode is {}", other.as_str_name())));
        }
        let e = check(&ProtocolConfiguration {
            request_body_mode: 99,
            ..config(fd, fd, true)
        });
        assert_eq!(e, Err(ModeError::RequestBody("unknown mode 99".into())));
    }
}
