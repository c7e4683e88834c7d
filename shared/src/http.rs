//! The one HTTP error format and the one auth layer of tally's APIs.
//!
//! Every error answer is `{"error":{"code","message"}}` with a 4xx or 5xx status
//! ([`ApiError`]); every API that takes a bearer token checks it with
//! [`require_bearer`].

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
