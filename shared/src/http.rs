//! The one HTTP error format, the one auth layer and the one page-token format of
//! tally's APIs.
//!
//! Every error answer is `{"error":{"code","message"}}` with a 4xx or 5xx status
//! ([`ApiError`]); every API that takes a bearer token checks it with
//! [`require_bearer`]; every paginated listing hands out [`page_token`]s.

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};

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

/// Requires `Authorization: Bearer <token>` on every route of `router` when a token
/// is configured; 401 `unauthorized` otherwise.
pub fn require_bearer<S: Clone + Send + Sync + 'static>(router: Router<S>, token: Option<String>) -> Router<S> {
    match token {
        Some(token) => router.route_layer(axum::middleware::from_fn_with_state(
            std::sync::Arc::new(format!("Bearer {token}")),
            authorize,
        )),
        None => router,
    }
}

async fn authorize(State(expected): State<std::sync::Arc<String>>, request: Request, next: Next) -> Response {
    let given = request.headers().get(AUTHORIZATION).and_then(|value| value.to_str().ok());
    if given != Some(expected.as_str()) {
        return ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "a valid bearer token is required")
            .into_response();
    }
    next.run(request).await
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
