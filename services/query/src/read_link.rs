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
