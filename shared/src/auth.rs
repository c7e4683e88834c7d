//! Who may call what (ARCHITECTURE.md, "Trust boundaries"): four roles, each with a
//! bearer token of its own (`[auth]`), checked by one layer on every route that
//! takes one.
//!
//! - **reader**: tally-query's `/v1` reads and the dashboard;
//! - **worker**: the brokers' dequeue, ack, nack and extend (and queue stats);
//! - **operator**: dead-job requeue and discard, `tally shards skip`, `tally
//!   snapshot`;
//! - **cluster**: the services' internal routes (counters' and tally-graph's reads,
//!   the read link, status), which only other tally services call.
//!
//! A role without a token is open to every caller that reaches the port: `tally up`
//! on loopback runs so, and says so once; `tally config check` lists the open roles.
//! A token shorter than [`MIN_TOKEN_BYTES`] is refused at start. Tokens are
//! compared through their SHA-256 digests in constant time.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde::{Deserialize, Serialize};
use subtle::ConstantTimeEq;

use crate::http::ApiError;
use crate::{Error, Result};

/// The shortest token accepted: 128 bits of hex or base64 are longer.
pub const MIN_TOKEN_BYTES: usize = 16;

/// A kind of caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    Reader,
    Worker,
    Operator,
    Cluster,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Reader, Role::Worker, Role::Operator, Role::Cluster];

    pub fn name(self) -> &'static str {
        match self {
            Role::Reader => "reader",
            Role::Worker => "worker",
            Role::Operator => "operator",
            Role::Cluster => "cluster",
        }
    }
}

/// `[auth]`: the roles' bearer tokens (`TALLY__AUTH__READER_TOKEN`…; in Helm, from
/// Secrets). Each service reads the ones it checks or sends.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// tally-query's `/v1` API asks for it; the CLI's reads send it.
    pub reader_token: Option<String>,
    /// The brokers' worker API asks for it; tally-worker sends it.
    pub worker_token: Option<String>,
    /// Dead-job decisions, shard skips and snapshots ask for it; the CLI sends it.
    pub operator_token: Option<String>,
    /// Every internal route asks for it; tally-query sends it to counters,
    /// tally-graph and brokers.
    pub cluster_token: Option<String>,
}

impl AuthConfig {
    pub fn token(&self, role: Role) -> Option<&str> {
        match role {
            Role::Reader => self.reader_token.as_deref(),
            Role::Worker => self.worker_token.as_deref(),
            Role::Operator => self.operator_token.as_deref(),
            Role::Cluster => self.cluster_token.as_deref(),
        }
    }

    /// The `Authorization` value a caller of `role` sends, when it has a token.
    /// The token `role` is given, to set it.
    pub fn token_mut(&mut self, role: Role) -> &mut Option<String> {
        match role {
            Role::Reader => &mut self.reader_token,
            Role::Worker => &mut self.worker_token,
            Role::Operator => &mut self.operator_token,
            Role::Cluster => &mut self.cluster_token,
        }
    }

    pub fn bearer(&self, role: Role) -> Option<String> {
        self.token(role).map(|token| format!("Bearer {token}"))
    }

    /// The roles anyone may act as: those without a token.
    pub fn open_roles(&self) -> Vec<Role> {
        Role::ALL.into_iter().filter(|role| self.token(*role).is_none()).collect()
    }

    /// Refuses a token that is empty, short, or holds whitespace (a pasted newline).
    pub fn check(&self) -> Result<()> {
        for role in Role::ALL {
            let Some(token) = self.token(role) else { continue };
            let key = format!("auth.{}_token", role.name());
            if token.len() < MIN_TOKEN_BYTES {
                return Err(Error::Config(format!(
                    "{key}: {} bytes; a token has at least {MIN_TOKEN_BYTES} (`openssl rand -hex 24` makes one), or leave it out to leave the role open",
                    token.len()
                )));
            }
            if token.bytes().any(|byte| byte.is_ascii_whitespace() || byte.is_ascii_control()) {
                return Err(Error::Config(format!("{key}: holds whitespace or a control character")));
            }
        }
        Ok(())
    }

    /// One line for people: which roles are open.
    pub fn describe_open_roles(&self) -> String {
        let open: Vec<&str> = self.open_roles().into_iter().map(Role::name).collect();
        match open.len() {
            0 => "every role asks for its token".to_string(),
            4 => "no tokens: every role (reader, worker, operator, cluster) is open to anyone who reaches a port"
                .to_string(),
            _ => format!("open to anyone who reaches a port (no token): {}", open.join(", ")),
        }
    }
}

/// Requires, on every route of `router`, the bearer token of one of `roles`: 401
/// `unauthorized` otherwise. A route one of whose roles is open stays open.
pub fn require<S: Clone + Send + Sync + 'static>(router: Router<S>, auth: &AuthConfig, roles: &[Role]) -> Router<S> {
    let mut digests = Vec::with_capacity(roles.len());
    for role in roles {
        match auth.token(*role) {
            Some(token) => digests.push(digest(token.as_bytes())),
            None => return router,
        }
    }
    router.route_layer(axum::middleware::from_fn_with_state(Arc::new(Accepted { digests }), authorize))
}

/// The digests of the tokens a route accepts.
struct Accepted {
    digests: Vec<[u8; 32]>,
}

impl Accepted {
    fn accepts(&self, authorization: Option<&[u8]>) -> bool {
        let Some(token) = authorization.and_then(|value| value.strip_prefix(b"Bearer ")) else { return false };
        let given = digest(token);
        // Every digest is compared, whichever matches.
        self.digests.iter().fold(false, |found, expected| found | bool::from(expected.ct_eq(&given)))
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, bytes).as_ref());
    out
}

async fn authorize(State(accepted): State<Arc<Accepted>>, request: Request, next: Next) -> Response {
    if !accepted.accepts(request.headers().get(AUTHORIZATION).map(|value| value.as_bytes())) {
        return ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "a valid bearer token is required")
            .into_response();
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use axum::routing::get;

    use super::*;

    const READER: &str = "reader-token-0123456789";
    const OPERATOR: &str = "operator-token-0123456789";

    fn auth() -> AuthConfig {
        AuthConfig { reader_token: Some(READER.into()), operator_token: Some(OPERATOR.into()), ..Default::default() }
    }

    /// Serves `router` on a loopback port; its base URL.
    async fn serve(router: Router) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, router).await });
        url
    }

    async fn status(url: &str, authorization: Option<&str>) -> u16 {
        let mut request = reqwest::Client::new().get(format!("{url}/x"));
        if let Some(value) = authorization {
            request = request.header(AUTHORIZATION, value);
        }
        request.send().await.unwrap().status().as_u16()
    }

    #[tokio::test]
    async fn a_route_answers_the_tokens_of_its_roles_only() {
        let route = || Router::new().route("/x", get(|| async { "ok" }));
        let operators = serve(require(route(), &auth(), &[Role::Operator])).await;
        let readers_or_operators = serve(require(route(), &auth(), &[Role::Reader, Role::Operator])).await;
        let with_an_open_role = serve(require(route(), &auth(), &[Role::Operator, Role::Worker])).await;
        let bearer = |token: &str| format!("Bearer {token}");
        let asked = [
            None,
            Some(bearer(READER)),
            Some(bearer(OPERATOR)),
            Some(OPERATOR.to_string()),
            Some(bearer(&OPERATOR[..OPERATOR.len() - 1])),
            Some(bearer("")),
        ];
        let mut answers = Vec::new();
        for authorization in &asked {
            let authorization = authorization.as_deref();
            answers.push((
                status(&operators, authorization).await,
                status(&readers_or_operators, authorization).await,
                status(&with_an_open_role, authorization).await,
            ));
        }
        assert_eq!(
            answers,
            vec![(401, 401, 200), (401, 200, 200), (200, 200, 200), (401, 401, 200), (401, 401, 200), (401, 401, 200)]
        );
    }

    #[test]
    fn short_empty_or_spaced_tokens_are_refused_naming_the_key() {
        let refused = |config: AuthConfig| config.check().unwrap_err().to_string();
        let reader = |token: &str| AuthConfig { reader_token: Some(token.into()), ..Default::default() };
        assert!(
            refused(reader("")).contains("auth.reader_token: 0 bytes; a token has at least 16"),
            "{}",
            refused(reader(""))
        );
        let short = AuthConfig { cluster_token: Some("fifteen-bytes!!".into()), ..Default::default() };
        assert!(refused(short).contains("auth.cluster_token: 15 bytes"));
        assert!(refused(reader("sixteen-bytes-ok\n")).contains("auth.reader_token: holds whitespace"));
        assert!(reader("sixteen-bytes-ok").check().is_ok());
        assert_eq!(auth().open_roles(), vec![Role::Worker, Role::Cluster]);
        assert_eq!(auth().describe_open_roles(), "open to anyone who reaches a port (no token): worker, cluster");
    }
}
