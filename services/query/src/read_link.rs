//! tally-query's end of the read link ([`tally_shared::read_link`]): one connection
//! per counter address, opened on first use and again after it breaks, shared by
//! every read to that counter at once. A reader task hands each answer to the read
//! waiting for its id; a broken link fails every read waiting on it, which the
//! fan-out treats as an unreachable owner. A counter that refuses the upgrade is
//! remembered for a minute as one to read over HTTP ([`LinkError::Unsupported`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tally_core::wire::{ReadRequest, ReadResponse};
use tally_shared::read_link::{frame, read_frame, write_frames, PATH, PROTOCOL};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

/// How long a counter that refused the upgrade is read over HTTP before the link
/// is tried again (it may have been upgraded meanwhile).
const HTTP_ONLY_FOR: Duration = Duration::from_secs(60);
/// Longest status line and headers a counter's upgrade answer may have.
const MAX_HEAD_BYTES: usize = 16 << 10;

#[derive(Debug, PartialEq, Eq)]
pub enum LinkError {
    /// The counter does not speak the read link: read over HTTP.
    Unsupported,
    /// The link could not be opened, broke, or gave no answer in time: what
    /// happened, for the log.
    Failed(String),
}

type Waiting = oneshot::Sender<Result<ReadResponse, String>>;

/// The read links of one tally-query, by counter address.
pub struct Links {
    slots: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Slot>>>>,
    /// How long a read waits for its answer (and an upgrade for its 101).
    timeout: Duration,
}

#[derive(Default)]
enum Slot {
    #[default]
    Closed,
    Open(Arc<Link>),
    HttpOnly(Instant),
}

struct Link {
    frames: mpsc::UnboundedSender<Vec<u8>>,
    state: Mutex<LinkState>,
}

#[derive(Default)]
struct LinkState {
    next_id: u64,
    waiting: HashMap<u64, Waiting>,
    /// Why the link closed; no read is added once it has.
    closed: Option<String>,
}

impl Links {
    pub fn new(timeout: Duration) -> Self {
        Self { slots: Mutex::default(), timeout }
    }

    /// Asks the counter at `addr` `request` over its link.
    pub async fn read(&self, addr: &str, request: &ReadRequest) -> Result<ReadResponse, LinkError> {
        let message = request.encode().map_err(|err| LinkError::Failed(err.to_string()))?;
        let link = self.link(addr).await?;
        let (answer, answered) = oneshot::channel();
        let id = {
            let mut state = lock(&link.state);
            if let Some(why) = &state.closed {
                return Err(LinkError::Failed(why.clone()));
            }
            let id = state.next_id;
            state.next_id += 1;
            state.waiting.insert(id, answer);
            id
        };
        let sent = frame(id, &message)
            .map_err(|err| err.to_string())
            .and_then(|bytes| link.frames.send(bytes).map_err(|_| "the read link closed".to_string()));
        if let Err(why) = sent {
            lock(&link.state).waiting.remove(&id);
            return Err(LinkError::Failed(why));
        }
        match tokio::time::timeout(self.timeout, answered).await {
            Ok(Ok(result)) => result.map_err(LinkError::Failed),
            Ok(Err(_)) => Err(LinkError::Failed("the read link closed".into())),
            Err(_) => {
                lock(&link.state).waiting.remove(&id);
                Err(LinkError::Failed(format!("no answer within {:?}", self.timeout)))
            }
        }
    }

    /// The open link to `addr`, opening one when there is none (one opening at a
    /// time per address; reads to other counters do not wait for it).
    async fn link(&self, addr: &str) -> Result<Arc<Link>, LinkError> {
        let slot = lock(&self.slots).entry(addr.to_string()).or_default().clone();
        let mut slot = slot.lock().await;
        match &*slot {
            Slot::Open(link) if lock(&link.state).closed.is_none() => return Ok(link.clone()),
            Slot::HttpOnly(since) if since.elapsed() < HTTP_ONLY_FOR => return Err(LinkError::Unsupported),
            _ => {}
        }
        match tokio::time::timeout(self.timeout, open(addr)).await {
            Ok(Ok(link)) => {
                *slot = Slot::Open(link.clone());
                Ok(link)
            }
            Ok(Err(LinkError::Unsupported)) => {
                tracing::info!(addr, "this counter does not open read links; reading from it over HTTP");
                *slot = Slot::HttpOnly(Instant::now());
                Err(LinkError::Unsupported)
            }
            Ok(Err(err)) => Err(err),
            Err(_) => Err(LinkError::Failed(format!("opening a read link to {addr} took over {:?}", self.timeout))),
        }
    }
}

/// Connects to `addr`, upgrades the connection to a read link, and starts its
/// reader and writer tasks.
async fn open(addr: &str) -> Result<Arc<Link>, LinkError> {
    let failed = |err: std::io::Error| LinkError::Failed(format!("{addr}: {err}"));
    let stream = TcpStream::connect(addr).await.map_err(failed)?;
    stream.set_nodelay(true).map_err(failed)?;
    let (reader, mut writer) = stream.into_split();
    let upgrade = format!("GET {PATH} HTTP/1.1\r\nhost: {addr}\r\nconnection: upgrade\r\nupgrade: {PROTOCOL}\r\n\r\n");
    writer.write_all(upgrade.as_bytes()).await.map_err(failed)?;
    let mut reader = BufReader::with_capacity(64 << 10, reader);
    let status = read_head(&mut reader).await.map_err(failed)?;
    if status != 101 {
        tracing::debug!(addr, status, "the read-link upgrade was answered without switching");
        return Err(LinkError::Unsupported);
    }
    let (frames, queue) = mpsc::unbounded_channel();
    let link = Arc::new(Link { frames, state: Mutex::default() });
    let weak = Arc::downgrade(&link);
    let addr = addr.to_string();
    tokio::spawn(async move {
        if let Err(err) = write_frames(writer, queue).await {
            tracing::debug!(addr, error = %err, "a read link's writer stopped");
        }
    });
    tokio::spawn(async move {
        let why = read_answers(&mut reader, &weak).await;
        tracing::debug!(why, "a read link closed");
        if let Some(link) = weak.upgrade() {
            let mut state = lock(&link.state);
            state.closed = Some(why.clone());
            for (_, waiting) in state.waiting.drain() {
                let _ = waiting.send(Err(why.clone()));
            }
        }
    });
    Ok(link)
}

/// Reads the answer to the upgrade up to its blank line: its status.
async fn read_head<R: AsyncRead + Unpin>(reader: &mut BufReader<R>) -> std::io::Result<u16> {
    let invalid = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    let (mut line, mut read) = (String::new(), 0);
    reader.read_line(&mut line).await?;
    let status = line.split(' ').nth(1).and_then(|code| code.parse().ok());
    let status = status.ok_or_else(|| invalid(format!("not an HTTP answer: {:?}", line.trim_end())))?;
    loop {
        read += line.len();
        if read > MAX_HEAD_BYTES {
            return Err(invalid("an upgrade answer's head over 16 KiB".into()));
        }
        line.clear();
        if reader.read_line(&mut line).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if line == "\r\n" {
            return Ok(status);
        }
    }
}

/// Hands every answer to the read waiting for it, until the link breaks or the
/// last holder of the link lets go: why it ended.
async fn read_answers<R: AsyncRead + Unpin>(reader: &mut R, link: &std::sync::Weak<Link>) -> String {
    let mut message = Vec::new();
    loop {
        let id = match read_frame(reader, &mut message).await {
            Ok(Some(id)) => id,
            Ok(None) => return "the counter closed the read link".into(),
            Err(err) => return format!("the read link broke: {err}"),
        };
        let answer = match ReadResponse::decode(&message) {
            Ok(answer) => answer,
            // Nothing on this link can be trusted after a frame that does not decode.
            Err(err) => return format!("a read-link answer did not decode: {err}"),
        };
        let Some(link) = link.upgrade() else { return "no longer used".into() };
        // An answer nobody waits for any more (its read timed out) is dropped.
        let waiting = lock(&link.state).waiting.remove(&id);
        if let Some(waiting) = waiting {
            let _ = waiting.send(Ok(answer));
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tally_core::wire::ShardOutcome;
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;

    use super::*;

    #[derive(Clone, Copy)]
    enum Peer {
        /// Answers the first two requests of a link in reverse order, later ones at once.
        Reversing,
        /// Closes its first link after reading a request; answers on later ones.
        ClosingFirst,
        /// Never answers.
        Silent,
        /// Answers the upgrade with 404, as a counter without links does.
        NoLinks,
    }

    /// An answer that says which request it is for: its clock.
    fn answer_to(request: &ReadRequest) -> ReadResponse {
        ReadResponse { shards: vec![ShardOutcome::Unavailable { message: format!("answer to {}", request.now_ms) }] }
    }

    fn request(now_ms: i64) -> ReadRequest {
        ReadRequest { now_ms, shards: Vec::new() }
    }

    /// A scripted counter on a free port: its address and how many connections it took.
    async fn peer(peer: Peer) -> (String, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let connections = Arc::new(AtomicUsize::new(0));
        let counted = connections.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let index = counted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(peer, index, stream));
            }
        });
        (addr, connections)
    }

    async fn serve(peer: Peer, index: usize, stream: TcpStream) {
        let (reader, mut writer) = stream.into_split();
        let mut reader = BufReader::new(reader);
        let mut line = String::new();
        while line != "\r\n" {
            line.clear();
            reader.read_line(&mut line).await.unwrap();
        }
        if let Peer::NoLinks = peer {
            writer.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n").await.unwrap();
            return;
        }
        let switching =
            format!("HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: {PROTOCOL}\r\n\r\n");
        writer.write_all(switching.as_bytes()).await.unwrap();
        let mut message = Vec::new();
        let mut held = Vec::new();
        while let Ok(Some(id)) = read_frame(&mut reader, &mut message).await {
            let request = ReadRequest::decode(&message).unwrap();
            match peer {
                Peer::Silent => continue,
                Peer::ClosingFirst if index == 0 => return,
                Peer::Reversing if held.is_empty() && request.now_ms < 2 => {
                    held.push((id, request));
                    continue;
                }
                _ => {}
            }
            held.insert(0, (id, request));
            for (id, request) in held.drain(..) {
                let answer = frame(id, &answer_to(&request).encode().unwrap()).unwrap();
                writer.write_all(&answer).await.unwrap();
            }
        }
    }

    #[tokio::test]
    async fn concurrent_reads_share_one_link_and_each_gets_its_own_answer() {
        let (addr, connections) = peer(Peer::Reversing).await;
        let links = Links::new(Duration::from_secs(5));
        let (zero, one) = (request(0), request(1));
        let (first, second) = tokio::join!(links.read(&addr, &zero), links.read(&addr, &one));
        assert_eq!((first, second), (Ok(answer_to(&request(0))), Ok(answer_to(&request(1)))));
        assert_eq!(links.read(&addr, &request(7)).await, Ok(answer_to(&request(7))));
        assert_eq!(connections.load(Ordering::SeqCst), 1, "one link for all three reads");
    }

    #[tokio::test]
    async fn a_broken_link_fails_its_reads_and_the_next_read_opens_another() {
        let (addr, connections) = peer(Peer::ClosingFirst).await;
        let links = Links::new(Duration::from_secs(5));
        let broken = links.read(&addr, &request(3)).await;
        assert_eq!(broken, Err(LinkError::Failed("the counter closed the read link".into())));
        assert_eq!(links.read(&addr, &request(4)).await, Ok(answer_to(&request(4))));
        assert_eq!(connections.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_read_without_an_answer_times_out() {
        let (addr, _) = peer(Peer::Silent).await;
        let links = Links::new(Duration::from_millis(300));
        let started = Instant::now();
        assert_eq!(links.read(&addr, &request(5)).await, Err(LinkError::Failed("no answer within 300ms".into())));
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert!(lock(&links.slots).values().all(|slot| match &*slot.try_lock().unwrap() {
            Slot::Open(link) => lock(&link.state).waiting.is_empty(),
            _ => false,
        }));
    }

    #[tokio::test]
    async fn a_counter_without_links_is_read_over_http_and_not_asked_again_for_a_while() {
        let (addr, connections) = peer(Peer::NoLinks).await;
        let links = Links::new(Duration::from_secs(5));
        assert_eq!(links.read(&addr, &request(6)).await, Err(LinkError::Unsupported));
        assert_eq!(links.read(&addr, &request(6)).await, Err(LinkError::Unsupported));
        assert_eq!(connections.load(Ordering::SeqCst), 1, "the refusal is remembered");
        let unreachable = Links::new(Duration::from_secs(5));
        let closed_port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().to_string()
        };
        assert!(
            matches!(unreachable.read(&closed_port, &request(6)).await, Err(LinkError::Failed(why)) if why.contains("refused")),
            "an unreachable counter is not one without links"
        );
    }
}
