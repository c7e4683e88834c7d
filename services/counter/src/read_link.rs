//! The counter's end of the read link ([`tally_shared::read_link`]): the upgrade
//! that opens it on the read port, then one task per link reading request frames and
//! answering each as [`crate::http`] answers `POST /internal/v2/read` (the same
//! inline-or-blocking-pool rule, the same outcomes), in whatever order they finish.
//! A frame that does not decode closes the link (logged): the client's reads on it
//! fail over as from an unreachable owner. The link closes when the counter stops.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::{CONNECTION, UPGRADE};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use tally_core::wire::ReadRequest;
use tally_shared::http::ApiError;
use tally_shared::read_link::{frame, read_frame, write_frames, PROTOCOL};
use tokio::io::{AsyncRead, AsyncWrite, BufReader};
use tokio::sync::mpsc;

use crate::http::{answer_read, answers_inline, ReadState};

/// `GET /internal/v1/read-link` with `Upgrade: tally-read-link.v1`: 101, then the
/// link. Without that upgrade: 400 `invalid_upgrade`.
pub(crate) async fn open(State(state): State<ReadState>, mut request: Request) -> Response {
    let asked = request.headers().get(UPGRADE).and_then(|value| value.to_str().ok());
    if asked != Some(PROTOCOL) {
        let message = format!("this path opens a read link: send `Upgrade: {PROTOCOL}`");
        return ApiError::new(StatusCode::BAD_REQUEST, "invalid_upgrade", message).into_response();
    }
    let upgrade = hyper::upgrade::on(&mut request);
    tokio::spawn(async move {
        match upgrade.await {
            Ok(upgraded) => serve(state, TokioIo::new(upgraded)).await,
            Err(err) => tracing::debug!(error = %err, "a read link's upgrade failed"),
        }
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(CONNECTION, "upgrade")
        .header(UPGRADE, PROTOCOL)
        .body(Body::empty())
        .unwrap_or_else(|err| {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", err.to_string()).into_response()
        })
}

/// Serves one link until the client closes it, it breaks, or the counter stops.
pub(crate) async fn serve<IO: AsyncRead + AsyncWrite + Send + 'static>(state: ReadState, io: IO) {
    let (reader, writer) = tokio::io::split(io);
    let (frames, queue) = mpsc::unbounded_channel();
    let writing = tokio::spawn(write_frames(writer, queue));
    let mut reader = BufReader::with_capacity(64 << 10, reader);
    let mut message = Vec::new();
    loop {
        let read = tokio::select! {
            _ = state.shutdown.cancelled() => break,
            read = read_frame(&mut reader, &mut message) => read,
        };
        let id = match read {
            Ok(Some(id)) => id,
            Ok(None) => break,
            Err(err) => {
                tracing::debug!(error = %err, "a read link broke");
                break;
            }
        };
        let request = match ReadRequest::decode(&message) {
            Ok(request) => request,
            Err(err) => {
                tracing::warn!(error = %err, "a read-link request did not decode; closing the link");
                break;
            }
        };
        let frames = frames.clone();
        if answers_inline(&request) {
            send(&frames, id, &answer_read(&state, request));
        } else {
            let state = state.clone();
            tokio::task::spawn_blocking(move || send(&frames, id, &answer_read(&state, request)));
        }
    }
    // The writer ends once the answers still being worked out are sent.
    drop(frames);
    if let Ok(Err(err)) = writing.await {
        tracing::debug!(error = %err, "a read link's writer stopped");
    }
}

fn send(frames: &mpsc::UnboundedSender<Vec<u8>>, id: u64, response: &tally_core::wire::ReadResponse) {
    match response
        .encode()
        .map_err(|err| err.to_string())
        .and_then(|bytes| frame(id, &bytes).map_err(|e| e.to_string()))
    {
        // A closed link (its writer gone) has no one to answer.
        Ok(bytes) => drop(frames.send(bytes)),
        // The client's read times out and fails over.
        Err(err) => tracing::error!(error = %err, "a read-link answer could not be encoded"),
    }
}
