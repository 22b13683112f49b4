//! The gRPC front door (`server.grpc_listen`): the engines' own gRPC services, routed rank by
//! rank like HTTP.
//!
//! ```text
//! identity, respond, auth   as for HTTP; errors become gRPC statuses (trailers-only)
//! route                     the method table: Generate, Embed and the engine-info calls go
//!                           down the stack to a picked rank; Abort, FlushCache, GetLoads and
//!                           grpc.health.v1 are answered here (local); the rest UNIMPLEMENTED
//! read, admit, retry, pick  the HTTP layers: the message is read whole and the rank field set
//!                           in it at the protobuf wire level (pbwire), every other byte kept
//! track                     which engine holds each in-flight request id, for Abort
//! observe, send             the HTTP layers, over one h2 connection per engine
//! ```
//!
//! Cancellation needs no code of its own: a client that cancels or goes away resets its stream,
//! hyper drops the response body, and with it the engine's stream, which h2 resets in turn.

mod answer;
mod calls;
mod local;
pub(crate) mod requests;
mod route;
pub(crate) mod status;
mod track;

pub use answer::{answered, status_response};
pub use calls::{pin, proxied, rank_field};
pub use local::Local;
pub use requests::Requests;
pub use route::Route;
pub use track::Track;

#[cfg(test)]
mod tests {
    use super::calls::*;
    use super::status::{percent_decode, status_headers};
    use crate::worker::Flavor;
    use tonic::Code;

    #[test]
    fn only_calls_an_engine_serves_count_among_a_clients_streams() {
        for service in [VLLM_SERVICE, SGLANG_SERVICE] {
            assert!(proxied(&format!("/{service}/Generate")));
            assert!(proxied(&format!("/{service}/GetModelInfo")));
            for method in ["Abort", "GetLoads", "FlushCache", "NoSuchMethod"] {
                assert!(
                    !proxied(&format!("/{service}/{method}")),
                    "{service}/{method}"
                );
            }
        }
        assert!(!proxied(&format!("/{HEALTH_SERVICE}/Check")));
        assert!(!proxied("/not-a-method"));
    }

    #[test]
    fn one_message_takes_exactly_one_uncompressed_frame() {
        let f = frame(b"\x0a\x01x");
        assert_eq!(one_message(&f).unwrap(), b"\x0a\x01x");
        assert_eq!(
            one_message(&f[..6]).unwrap_err().code,
            Code::InvalidArgument
        );
        let two = [&f[..], &f[..]].concat();
        assert_eq!(one_message(&two).unwrap_err().code, Code::InvalidArgument);
        let mut compressed = f.to_vec();
        compressed[0] = 1;
        assert_eq!(
            one_message(&compressed).unwrap_err().code,
            Code::Unimplemented
        );
        assert_eq!(one_message(b"").unwrap_err().code, Code::InvalidArgument);
    }

    #[test]
    fn status_message_round_trips_through_percent_encoding() {
        let h = status_headers(Code::Unavailable, "http://h:1@0: 100% gone\nnow é");
        let m = h.get("grpc-message").unwrap().to_str().unwrap();
        assert!(!m.contains('\n') && m.contains("%25"), "{m}");
        assert_eq!(percent_decode(m), "http://h:1@0: 100% gone\nnow é");
        assert_eq!(h.get("grpc-status").unwrap(), "14");
    }

    #[test]
    fn method_table_per_flavor() {
        assert_eq!(rank_field("/vllm.grpc.engine.VllmEngine/Generate"), Some(9));
        assert_eq!(
            rank_field("/sglang.grpc.scheduler.SglangScheduler/Generate"),
            Some(16)
        );
        assert_eq!(
            rank_field("/sglang.grpc.scheduler.SglangScheduler/Embed"),
            Some(8)
        );
        assert_eq!(rank_field("/vllm.grpc.engine.VllmEngine/Embed"), None);
        assert_eq!(
            rank_field("/vllm.grpc.engine.VllmEngine/StartProfile"),
            None
        );
        assert_eq!(call(Flavor::Vllm, "SubscribeKvEvents"), None);
    }

    #[test]
    fn request_id_is_field_one() {
        // field 1 "ab", field 9 = 1
        let msg = [0x0a, 2, b'a', b'b', 0x48, 1];
        assert_eq!(
            request_id("/vllm.grpc.engine.VllmEngine/Generate", &msg),
            Some("ab")
        );
        assert_eq!(
            request_id("/vllm.grpc.engine.VllmEngine/GetServerInfo", &msg),
            None
        );
    }
}
