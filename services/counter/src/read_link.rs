//! The counter's end of the read link ([`tally_shared::read_link`]): the upgrade
//! that opens it on the read port, then one task per link reading request frames and
//! answering each as [`crate::http`] answers `POST /internal/v2/read` (the same
//! inline-or-blocking-pool rule, the same outcomes), in whatever order they finish.
//! A frame that does not decode, or is over 4 MiB, closes the link (logged): the
//! client's reads on it fail over as from an unreachable owner. A read on the
//! blocking pool that panics, and an answer too large to send, are answered
//! `unavailable`, never left without an answer (a panic in an inline read, a point
//! read or two, ends the link's task and so closes the link). The link closes when
//! the counter stops. A link has at most [`MAX_IN_FLIGHT`] reads on the blocking pool
//! at once; past that it reads no more frames until one is answered.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::{CONNECTION, UPGRADE};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use tally_core::wire::{FreshReadResponse, ReadRequest, ShardOutcome};
use tally_shared::http::ApiError;
use tally_shared::read_link::{frame, read_frame, write_frames, MAX_REQUEST_BYTES, PROTOCOL, PROTOCOL_FRESH};
use tokio::io::{AsyncRead, AsyncWrite, BufReader};
use tokio::sync::mpsc;

use crate::http::{answer_read, answers_inline, ReadState, Served};

/// `GET /internal/v1/read-link` with `Upgrade: tally-read-link.v1`: 101, then the
/// link. Without that upgrade: 400 `invalid_upgrade`.
pub(crate) async fn open(State(state): State<ReadState>, mut request: Request) -> Response {
    let asked = request.headers().get(UPGRADE).and_then(|value| value.to_str().ok());
    let protocol = match asked {
        Some(PROTOCOL_FRESH) => PROTOCOL_FRESH,
        Some(PROTOCOL) => PROTOCOL,
        _ => "",
    };
    // Without hyper's upgrade handle (an HTTP/1.0 request) there is nothing to switch.
    if protocol.is_empty() || request.extensions().get::<hyper::upgrade::OnUpgrade>().is_none() {
        let message = format!("this path opens a read link: send `Upgrade: {PROTOCOL_FRESH}` (or {PROTOCOL})");
        return ApiError::new(StatusCode::BAD_REQUEST, "invalid_upgrade", message).into_response();
    }
    let upgrade = hyper::upgrade::on(&mut request);
    let fresh = protocol == PROTOCOL_FRESH;
    tokio::spawn(async move {
        match upgrade.await {
            Ok(upgraded) => serve(state, TokioIo::new(upgraded), fresh).await,
            Err(err) => tracing::debug!(error = %err, "a read link's upgrade failed"),
        }
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(CONNECTION, "upgrade")
        .header(UPGRADE, protocol)
        .body(Body::empty())
        .unwrap_or_else(|err| {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", err.to_string()).into_response()
        })
}

/// The most reads one link has on the blocking pool at once: the next request
/// frame is read only once one of them is answered (the client's writes wait in
/// TCP), so a link takes a bounded share of the pool whatever its client sends.
/// (Answers wait for the writer unbounded: a client that writes and never reads
/// holds them until its link breaks.)
pub(crate) const MAX_IN_FLIGHT: usize = 256;

/// Serves one link until the client closes it, it breaks, or the counter stops;
/// its answers say how fresh each shard was when `fresh` (link version 2).
pub(crate) async fn serve<IO: AsyncRead + AsyncWrite + Send + 'static>(state: ReadState, io: IO, fresh: bool) {
    let in_flight = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
    let (reader, writer) = tokio::io::split(io);
    let (frames, queue) = mpsc::unbounded_channel();
    let writing = tokio::spawn(write_frames(writer, queue));
    let mut reader = BufReader::with_capacity(64 << 10, reader);
    let mut message = Vec::new();
    loop {
        let read = tokio::select! {
            _ = state.shutdown.cancelled() => break,
            read = read_frame(&mut reader, &mut message, MAX_REQUEST_BYTES) => read,
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
        if answers_inline(&request) {
            send(&frames, id, answer_read(&state, request, Served::Owned), fresh);
            continue;
        }
        let permit = tokio::select! {
            _ = state.shutdown.cancelled() => break,
            permit = in_flight.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
        };
        let (state, frames, shards) = (state.clone(), frames.clone(), request.shards.len());
        let reading = tokio::task::spawn_blocking(move || answer_read(&state, request, Served::Owned));
        tokio::spawn(async move {
            let response = reading.await.unwrap_or_else(|err| unavailable(shards, format!("the read failed: {err}")));
            send(&frames, id, response, fresh);
            drop(permit);
        });
    }
    // The writer ends once the answers still being worked out are sent.
    drop(frames);
    if let Ok(Err(err)) = writing.await {
        tracing::debug!(error = %err, "a read link's writer stopped");
    }
}

/// The answer for `shards` shards that could not be read.
fn unavailable(shards: usize, message: String) -> FreshReadResponse {
    FreshReadResponse { shards: vec![ShardOutcome::Unavailable { message }; shards], as_of: vec![None; shards] }
}

/// Sends the answer to request `id` (with the shards' freshness on a `fresh`
/// link); one that cannot be framed (over 64 MiB) is answered as unavailable, so
/// the read fails now rather than at its timeout.
fn send(frames: &mpsc::UnboundedSender<Vec<u8>>, id: u64, response: FreshReadResponse, fresh: bool) {
    let framed = |response: FreshReadResponse| -> Result<Vec<u8>, String> {
        let message = match fresh {
            true => response.encode(),
            false => response.without_freshness().encode(),
        };
        frame(id, &message.map_err(|err| err.to_string())?).map_err(|err| err.to_string())
    };
    let shards = response.shards.len();
    let bytes = framed(response).or_else(|err| {
        tracing::error!(error = %err, "a read-link answer could not be sent");
        framed(unavailable(shards, format!("the answer could not be sent: {err}")))
    });
    // A closed link (its writer gone) has no one to answer.
    if let Ok(bytes) = bytes {
        if frames.send(bytes).is_err() {
            tracing::debug!(id, "the link closed before its answer went out");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use tally_core::time::WindowSpec;
    use tally_core::wire::{Kind, ReadResponse, ShardAnswer, ShardAsOf, ShardQueries, ShardQuery};
    use tally_shared::read_link::{MAX_FRAME_BYTES, PATH};
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio_util::sync::CancellationToken;

    use super::*;

    const NOW: i64 = 1_763_780_000_000;

    /// A counter's read API on a free port, owning shard 0 with `user:1` at 3 views
    /// (2 in the last hour) and `user:2` at 5.
    async fn counter() -> (tempfile::TempDir, String, ReadState) {
        let dir = tempfile::tempdir().unwrap();
        let events = [("user:1", 1, NOW - 7_200_000), ("user:1", 2, NOW - 60_000), ("user:2", 5, NOW)];
        let shards = crate::shards::one_shard_with(dir.path(), &events, NOW, false);
        let metrics = crate::metrics::Metrics::new(&prometheus::Registry::new());
        let state = ReadState { shards, metrics, snapshots: false, shutdown: CancellationToken::new() };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let app = crate::http::router(state.clone(), &Default::default());
        tokio::spawn(async move { axum::serve(listener, app).await });
        (dir, addr, state)
    }

    /// Sends `head` and reads the answer's head: its status line and the stream.
    async fn upgrade(addr: &str, head: &str) -> (String, BufReader<TcpStream>) {
        let mut stream = BufReader::new(TcpStream::connect(addr).await.unwrap());
        stream.get_mut().write_all(head.as_bytes()).await.unwrap();
        let mut status = String::new();
        stream.read_line(&mut status).await.unwrap();
        let mut line = String::new();
        while line != "\r\n" {
            line.clear();
            stream.read_line(&mut line).await.unwrap();
        }
        (status.trim_end().to_string(), stream)
    }

    /// The request that opens a link.
    fn link_head() -> String {
        format!("GET {PATH} HTTP/1.1\r\nhost: t\r\nconnection: upgrade\r\nupgrade: {PROTOCOL}\r\n\r\n")
    }

    /// Asserts that the counter closes `link` (within 5 s) without another frame.
    async fn assert_closed(link: &mut BufReader<TcpStream>) {
        let mut message = Vec::new();
        let next = read_frame(link, &mut message, MAX_FRAME_BYTES);
        let next = tokio::time::timeout(std::time::Duration::from_secs(5), next);
        assert_eq!(next.await.expect("the link closes").unwrap(), None);
    }

    fn query(entity: &str, spec: WindowSpec) -> ShardQuery {
        ShardQuery::plain(entity.into(), "views".into(), Kind::Total, spec)
    }

    fn window(value: i64, resolution: &str, from: i64, to: i64) -> ShardAnswer {
        ShardAnswer::Window { value: value.into(), resolution: resolution.into(), from, to }
    }

    #[tokio::test]
    async fn a_link_answers_every_request_by_its_id_as_the_json_api_does() {
        let (_dir, addr, state) = counter().await;
        let (status, mut link) = upgrade(&addr, &link_head()).await;
        assert_eq!(status, "HTTP/1.1 101 Switching Protocols");
        // An all-time total (answered inline), a window (on the blocking pool) and a
        // shard this counter does not own, on one connection at once.
        let requests = [
            ReadRequest {
                now_ms: NOW,
                shards: vec![ShardQueries { shard: 0, queries: vec![query("user:2", WindowSpec::All)] }],
            },
            ReadRequest {
                now_ms: NOW,
                shards: vec![ShardQueries {
                    shard: 0,
                    queries: vec![
                        query("user:1", WindowSpec::Last { window_ms: 3_600_000 }),
                        query("user:1", WindowSpec::All),
                        query("nobody", WindowSpec::All),
                    ],
                }],
            },
            ReadRequest {
                now_ms: NOW,
                shards: vec![ShardQueries { shard: 5, queries: vec![query("x", WindowSpec::All)] }],
            },
        ];
        let mut frames = Vec::new();
        for (id, request) in [40u64, 41, 42].into_iter().zip(&requests) {
            frames.extend(frame(id, &request.encode().unwrap()).unwrap());
        }
        link.get_mut().write_all(&frames).await.unwrap();
        let mut answers = BTreeMap::new();
        let mut message = Vec::new();
        for _ in 0..3 {
            let id = read_frame(&mut link, &mut message, MAX_FRAME_BYTES).await.unwrap().unwrap();
            answers.insert(id, ReadResponse::decode(&message).unwrap());
        }
        let one = |answers| ReadResponse { shards: vec![ShardOutcome::Answers { answers }] };
        let want = BTreeMap::from([
            (40, one(vec![window(5, "all", 0, NOW)])),
            (
                41,
                one(vec![
                    window(2, "1m", NOW / 60_000 * 60_000 - 3_540_000, NOW),
                    window(3, "all", 0, NOW),
                    window(0, "all", 0, NOW),
                ]),
            ),
            (42, ReadResponse { shards: vec![ShardOutcome::NotOwner] }),
        ]);
        assert_eq!(answers, want);

        // The JSON API answers the same request alike.
        let json: ReadResponse = reqwest::Client::new()
            .post(format!("http://{addr}/internal/v2/read"))
            .json(&requests[1])
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(json, want[&41]);

        // A frame that is not a read request closes the link.
        link.get_mut().write_all(&frame(43, b"not a request").unwrap()).await.unwrap();
        assert_closed(&mut link).await;

        // A link of version 2 answers alike, with how fresh the shard was: all of
        // its log applied (one record), caught up when its end was last seen.
        let store = state.shards.get(0).unwrap();
        store.freshness.learned_end(1, tally_shared::kafka::now_ms());
        let fresh_head = link_head().replace(PROTOCOL, PROTOCOL_FRESH);
        let (status, mut link) = upgrade(&addr, &fresh_head).await;
        assert_eq!(status, "HTTP/1.1 101 Switching Protocols");
        link.get_mut().write_all(&frame(44, &requests[1].encode().unwrap()).unwrap()).await.unwrap();
        assert_eq!(read_frame(&mut link, &mut message, MAX_FRAME_BYTES).await.unwrap(), Some(44));
        let fresh = FreshReadResponse::decode(&message).unwrap();
        assert_eq!(fresh.shards, want[&41].shards);
        let as_of = fresh.as_of.iter().map(|as_of| as_of.map(|a| (a.applied, a.lag_ms.is_some_and(|lag| lag < 5_000))));
        assert_eq!(as_of.collect::<Vec<_>>(), vec![Some((1, true))]);
        let _: Option<ShardAsOf> = fresh.as_of[0];
    }

    /// More requests than a link may have in flight, sent at once: each is answered,
    /// the later ones as earlier ones finish.
    #[tokio::test]
    async fn requests_past_the_in_flight_bound_wait_their_turn() {
        let (_dir, addr, _state) = counter().await;
        let (_, mut link) = upgrade(&addr, &link_head()).await;
        let request = ReadRequest {
            now_ms: NOW,
            shards: vec![ShardQueries {
                shard: 0,
                queries: vec![query("user:1", WindowSpec::Last { window_ms: 3_600_000 })],
            }],
        };
        assert!(!answers_inline(&request), "answered on the blocking pool");
        let mut segmented = ReadRequest {
            now_ms: NOW,
            shards: vec![ShardQueries { shard: 0, queries: vec![query("user:1", WindowSpec::All)] }],
        };
        assert!(answers_inline(&segmented), "one all-time total inline");
        segmented.shards[0].queries[0].segments = Some(tally_core::segments::Selector::default());
        assert!(!answers_inline(&segmented), "a segment query walks combinations: on the blocking pool");
        let sent = MAX_IN_FLIGHT as u64 * 2 + 17;
        let mut frames = Vec::new();
        for id in 0..sent {
            frames.extend(frame(id, &request.encode().unwrap()).unwrap());
        }
        link.get_mut().write_all(&frames).await.unwrap();
        let mut answered = BTreeMap::new();
        let mut message = Vec::new();
        for _ in 0..sent {
            let id = read_frame(&mut link, &mut message, MAX_FRAME_BYTES).await.unwrap().unwrap();
            answered.insert(id, ReadResponse::decode(&message).unwrap());
        }
        let want = ReadResponse {
            shards: vec![ShardOutcome::Answers {
                answers: vec![window(2, "1m", NOW / 60_000 * 60_000 - 3_540_000, NOW)],
            }],
        };
        assert_eq!(answered, (0..sent).map(|id| (id, want.clone())).collect::<BTreeMap<_, _>>());
    }

    #[tokio::test]
    async fn a_get_that_cannot_upgrade_is_refused_and_stopping_the_counter_closes_its_links() {
        let (_dir, addr, state) = counter().await;
        let plain = format!("GET {PATH} HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n");
        // HTTP/1.0 has no upgrades, whatever the headers say.
        let old = format!("GET {PATH} HTTP/1.0\r\nconnection: upgrade\r\nupgrade: {PROTOCOL}\r\n\r\n");
        for (head, status_line) in [(plain, "HTTP/1.1 400 Bad Request"), (old, "HTTP/1.0 400 Bad Request")] {
            let (status, mut refused) = upgrade(&addr, &head).await;
            assert_eq!(status, status_line);
            let mut body = Vec::new();
            refused.read_to_end(&mut body).await.unwrap();
            let error: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let message = format!("this path opens a read link: send `Upgrade: {PROTOCOL_FRESH}` (or {PROTOCOL})");
            assert_eq!(error, serde_json::json!({"error": {"code": "invalid_upgrade", "message": message}}));
        }

        // A request frame over 4 MiB closes the link.
        let (_, mut link) = upgrade(&addr, &link_head()).await;
        let mut huge = (MAX_REQUEST_BYTES as u32 + 1).to_be_bytes().to_vec();
        huge.extend_from_slice(&[0; 8]);
        link.get_mut().write_all(&huge).await.unwrap();
        assert_closed(&mut link).await;

        let (status, mut link) = upgrade(&addr, &link_head()).await;
        assert_eq!(status, "HTTP/1.1 101 Switching Protocols");
        state.shutdown.cancel();
        assert_closed(&mut link).await;
    }
}
