//! The one HTTP server loop, the one HTTP error format and the one page-token
//! format of tally's APIs.
//!
//! Every API is served by [`serve`] (or [`spawn_serve`]): connections without
//! Nagle's delay ([`no_delay`]).
//!
//! Every error answer is `{"error":{"code","message"}}` with a 4xx or 5xx status
//! ([`ApiError`]); every paginated listing hands out [`page_token`]s. Bearer
//! tokens are checked by [`crate::auth`].

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::serve::{ListenerExt, TapIo};
use axum::{Json, Router};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// An HTTP error answer: status, a stable machine-readable code, a message for people.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, code, message: message.into() }
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    /// Nothing can answer for a shard right now; retrying later may work.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "shard_unavailable", message)
    }

    /// A shard (or partition) stopped by a failure until an operator acts.
    pub fn shard_failed(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "shard_failed", message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({"error": {"code": self.code, "message": self.message}});
        (self.status, Json(body)).into_response()
    }
}

/// `listener`, setting `TCP_NODELAY` on every connection it accepts. With Nagle's
/// algorithm on, an answer written while the connection's previous answer is still
/// unacknowledged waits until the peer's next packet brings the ACK; the peer
/// delays its ACK, so on a connection that carries request after request (a read
/// link: one request every 2 ms at 500 reads/s) every answer waited for the next
/// request, phase after phase (BENCHMARKS.md, "Reads").
pub fn no_delay(listener: TcpListener) -> TapIo<TcpListener, fn(&mut TcpStream)> {
    fn set_no_delay(connection: &mut TcpStream) {
        if let Err(err) = connection.set_nodelay(true) {
            tracing::debug!(error = %err, "a connection keeps Nagle's delay");
        }
    }
    listener.tap_io(set_no_delay as fn(&mut TcpStream))
}

/// Serves `router` on `listener` ([`no_delay`]) until `shutdown`, then lets the
/// requests in progress finish.
pub async fn serve(listener: TcpListener, router: Router, shutdown: CancellationToken) -> std::io::Result<()> {
    axum::serve(no_delay(listener), router).with_graceful_shutdown(shutdown.cancelled_owned()).await
}

/// [`serve`] on a task of its own; a failure is logged as `what` failing.
pub fn spawn_serve(what: &'static str, listener: TcpListener, router: Router, shutdown: CancellationToken) {
    tokio::spawn(async move {
        if let Err(err) = serve(listener, router, shutdown).await {
            tracing::error!(error = %err, "{what} failed");
        }
    });
}

/// Opaque page tokens: a kind tag (which listing, which version of its token) and
/// the fields a listing resumes from, `:`-joined (the last field may hold `:`),
/// base64url. A token of another kind, or with another number of fields, is not
/// one this listing issued.
pub mod page_token {
    use base64::Engine;

    /// The token of a `kind` listing resuming from `fields`.
    pub fn encode(kind: &str, fields: &[&str]) -> String {
        let text = std::iter::once(kind).chain(fields.iter().copied()).collect::<Vec<_>>().join(":");
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(text)
    }

    /// The `count` fields of a `kind` token; `None` for anything else.
    pub fn decode(token: &str, kind: &str, count: usize) -> Option<Vec<String>> {
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(token).ok()?;
        let text = String::from_utf8(bytes).ok()?;
        let mut parts = text.splitn(count + 1, ':');
        if parts.next()? != kind {
            return None;
        }
        let fields: Vec<String> = parts.map(str::to_string).collect();
        (fields.len() == count).then_some(fields)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn tokens_round_trip_and_other_kinds_are_refused() {
            let token = encode("c2", &["17", "-3", "a:b:c"]);
            assert_eq!(decode(&token, "c2", 3), Some(vec!["17".into(), "-3".into(), "a:b:c".into()]));
            assert_eq!(decode(&token, "d1", 3), None);
            assert_eq!(decode(&encode("c2", &["17", "-3"]), "c2", 3), None, "too few fields");
            assert_eq!(decode(&encode("n1", &["views"]), "n1", 1), Some(vec!["views".into()]));
            assert_eq!(decode("!!", "n1", 1), None);
            assert_eq!(decode(&encode("n1", &[]), "n1", 1), None);
        }
    }
}

#[cfg(test)]
mod tests {
    use axum::serve::Listener;

    use super::*;

    #[tokio::test]
    async fn accepted_connections_have_nagles_delay_off() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut served = no_delay(listener);
        for _ in 0..2 {
            let client = TcpStream::connect(addr).await.unwrap();
            let (connection, peer) = served.accept().await;
            assert_eq!(peer, client.local_addr().unwrap());
            assert!(connection.nodelay().unwrap(), "an accepted connection keeps Nagle's delay");
            assert!(!client.nodelay().unwrap(), "the client's end is the client's to set");
        }
    }
}
