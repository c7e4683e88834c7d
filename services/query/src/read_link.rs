//! tally-query's end of the read link ([`tally_shared::read_link`]): one connection
//! per counter address, opened on first use and again after it closes, shared by
//! every read to that counter at once. A reader task hands each answer to the read
//! waiting for its id. Each read has one deadline (10 s) for everything: waiting
//! for a link, opening it, its answer.
//!
//! - A link that closes (the counter stopped or closed it, a frame that did not
//!   decode) fails every read waiting on it. A read that had found the link already
//!   open tries once more on a new one (reads change nothing); otherwise the fan-out
//!   treats the failure as an unreachable owner and waits for a newer claim.
//! - A read that times out after waiting half its deadline or more, with no answer
//!   of any read arriving on its link since it was sent, closes the link (a paused
//!   or cut-off counter): later reads open a new one instead of queueing behind it.
//! - A link that cannot be opened fails the reads that were queued behind the
//!   attempt too, at once, instead of each trying again; later reads try again.
//! - A counter that refuses the upgrade (any answer but 101) is remembered for a
//!   minute as one to read over HTTP ([`LinkError::Unsupported`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tally_core::wire::{FreshReadResponse, ReadRequest};
use tally_shared::lock::lock;
use tally_shared::read_link::{frame, read_frame, write_frames, MAX_FRAME_BYTES, PATH, PROTOCOL_FRESH};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio::time::{timeout_at, Instant};

/// How long a counter that refused the upgrade is read over HTTP before the link
/// is tried again (it may have been upgraded meanwhile).
const HTTP_ONLY_FOR: Duration = Duration::from_secs(60);
/// Longest status line and headers a counter's upgrade answer may have.
const MAX_HEAD_BYTES: u64 = 16 << 10;
/// What [`Links::slots`]' and [`Link::state`]'s locks guard ([`tally_shared::lock`]).
const SLOTS: &str = "the read links by counter";
const LINK_STATE: &str = "a read link's state";

/// Why a read over a link got no answer. Not an error of the service: it tells the
/// fan-out what to do next.
#[derive(Debug, PartialEq, Eq)]
pub enum LinkError {
    /// The counter does not speak the read link: read over HTTP.
    Unsupported,
    /// The link could not be opened, closed, or gave no answer in time: what
    /// happened, for the log.
    Failed(String),
}

type Waiting = oneshot::Sender<Result<FreshReadResponse, String>>;

/// The read links of one tally-query, by counter address.
pub struct Links {
    slots: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Slot>>>>,
    /// How long a read may take, all told.
    timeout: Duration,
    /// The `Authorization` value each link's upgrade request carries (the cluster
    /// token), when one is set.
    authorization: Option<String>,
}

#[derive(Default)]
enum Slot {
    #[default]
    Closed,
    Open(Arc<Link>),
    Failed(Instant, String),
    HttpOnly(Instant),
}

struct Link {
    state: Mutex<LinkState>,
}

#[derive(Default)]
struct LinkState {
    /// To the writer task; `None` once the link closed, which ends the writer.
    frames: Option<mpsc::UnboundedSender<Vec<u8>>>,
    next_id: u64,
    waiting: HashMap<u64, Waiting>,
    /// Why the link closed; no read is added once it has.
    closed: Option<String>,
    /// Answers read from the link so far.
    answers: u64,
    /// The reader and writer tasks, stopped when the link closes (a paused counter
    /// would hold them and the socket until it resumes).
    tasks: Vec<tokio::task::AbortHandle>,
}

impl Link {
    fn is_open(&self) -> bool {
        lock(&self.state, LINK_STATE).closed.is_none()
    }

    /// Closes the link (the first reason stays): every waiting read fails with
    /// `why`, and the writer ends, which closes the connection.
    fn close(&self, why: String) {
        let mut state = lock(&self.state, LINK_STATE);
        let why = state.closed.get_or_insert(why).clone();
        state.frames = None;
        for task in state.tasks.drain(..) {
            task.abort();
        }
        for (_, waiting) in state.waiting.drain() {
            if waiting.send(Err(why.clone())).is_err() {
                tracing::debug!(reason = %why, "a read gave up before its link closed");
            }
        }
    }
}

/// A read's place among its link's waiting reads, given up when the read ends
/// however it ends (answered, timed out, or dropped by its caller).
struct Registered<'a> {
    link: &'a Link,
    id: u64,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        lock(&self.link.state, LINK_STATE).waiting.remove(&self.id);
    }
}

/// How one attempt on a link ended without an answer.
enum Unanswered {
    /// The link closed (before or while waiting).
    Closed(String),
    /// Something else: the read cannot be sent, or its time ran out.
    Failed(String),
}

impl Links {
    pub fn new(timeout: Duration) -> Self {
        Self { slots: Mutex::default(), timeout, authorization: None }
    }

    /// Links that present `authorization` (`Bearer <cluster token>`) when they open.
    pub fn authorized(mut self, authorization: Option<String>) -> Self {
        self.authorization = authorization;
        self
    }

    /// How long a read may take, all told.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Asks the counter at `addr` `request` over its link.
    pub async fn read(&self, addr: &str, request: &ReadRequest) -> Result<FreshReadResponse, LinkError> {
        let message = request.encode().map_err(|err| LinkError::Failed(err.to_string()))?;
        let deadline = Instant::now() + self.timeout;
        let (link, reused) = self.link(addr, deadline).await?;
        let why = match self.exchange(&link, &message, deadline).await {
            Ok(answer) => return Ok(answer),
            // A link found open may have closed while idle: once more on a new one.
            Err(Unanswered::Closed(_)) if reused => {
                let (link, _) = self.link(addr, deadline).await?;
                match self.exchange(&link, &message, deadline).await {
                    Ok(answer) => return Ok(answer),
                    Err(Unanswered::Closed(why) | Unanswered::Failed(why)) => why,
                }
            }
            Err(Unanswered::Closed(why) | Unanswered::Failed(why)) => why,
        };
        Err(LinkError::Failed(why))
    }

    /// Sends `message` on `link` and waits for its answer until `deadline`.
    async fn exchange(&self, link: &Link, message: &[u8], deadline: Instant) -> Result<FreshReadResponse, Unanswered> {
        let (answer, answered) = oneshot::channel();
        let (id, answers_before) = {
            let mut state = lock(&link.state, LINK_STATE);
            let id = state.next_id;
            let Some(frames) = &state.frames else {
                return Err(Unanswered::Closed(state.closed.clone().unwrap_or_default()));
            };
            let bytes = frame(id, message).map_err(|err| Unanswered::Failed(err.to_string()))?;
            if frames.send(bytes).is_err() {
                return Err(Unanswered::Closed("the read link's writer stopped".into()));
            }
            state.next_id += 1;
            state.waiting.insert(id, answer);
            (id, state.answers)
        };
        let (_registered, sent) = (Registered { link, id }, Instant::now());
        match timeout_at(deadline, answered).await {
            Ok(Ok(Ok(answer))) => Ok(answer),
            Ok(Ok(Err(why))) => Err(Unanswered::Closed(why)),
            Ok(Err(_)) => Err(Unanswered::Closed("the read link closed".into())),
            Err(_) => {
                let why = format!("no answer within {:?}", self.timeout);
                // Silent for half a deadline or more (not a read that came late to
                // its link with moments left): the counter is paused or cut off.
                let silent = lock(&link.state, LINK_STATE).answers == answers_before;
                if silent && sent.elapsed() >= self.timeout / 2 {
                    link.close(format!("{why}, nor to any later read"));
                }
                Err(Unanswered::Failed(why))
            }
        }
    }

    /// The open link to `addr` and whether it was open already, opening one when
    /// there is none (one opening at a time per address; reads to other counters do
    /// not wait for it).
    async fn link(&self, addr: &str, deadline: Instant) -> Result<(Arc<Link>, bool), LinkError> {
        let late = || LinkError::Failed(format!("no read link to {addr} within {:?}", self.timeout));
        let waiting_since = Instant::now();
        let slot = lock(&self.slots, SLOTS).entry(addr.to_string()).or_default().clone();
        let mut slot = timeout_at(deadline, slot.lock()).await.map_err(|_| late())?;
        match &*slot {
            Slot::Open(link) if link.is_open() => return Ok((link.clone(), true)),
            Slot::HttpOnly(since) if since.elapsed() < HTTP_ONLY_FOR => return Err(LinkError::Unsupported),
            // An opening that failed while this read waited for it is its answer too.
            Slot::Failed(at, why) if *at >= waiting_since => return Err(LinkError::Failed(why.clone())),
            _ => {}
        }
        let opened =
            timeout_at(deadline, open(addr, self.authorization.as_deref())).await.unwrap_or_else(|_| Err(late()));
        match opened {
            Ok(link) => {
                *slot = Slot::Open(link.clone());
                Ok((link, false))
            }
            Err(LinkError::Unsupported) => {
                tracing::info!(addr, "this counter does not open read links; reading from it over HTTP");
                *slot = Slot::HttpOnly(Instant::now());
                Err(LinkError::Unsupported)
            }
            Err(LinkError::Failed(why)) => {
                *slot = Slot::Failed(Instant::now(), why.clone());
                Err(LinkError::Failed(why))
            }
        }
    }
}

/// Connects to `addr`, upgrades the connection to a read link, and starts its
/// reader and writer tasks.
async fn open(addr: &str, authorization: Option<&str>) -> Result<Arc<Link>, LinkError> {
    let failed = |err: std::io::Error| LinkError::Failed(format!("{addr}: {err}"));
    let stream = TcpStream::connect(addr).await.map_err(failed)?;
    stream.set_nodelay(true).map_err(failed)?;
    let (reader, mut writer) = stream.into_split();
    let credential = authorization.map(|value| format!("authorization: {value}\r\n")).unwrap_or_default();
    let upgrade = format!(
        "GET {PATH} HTTP/1.1\r\nhost: {addr}\r\nconnection: upgrade\r\nupgrade: {PROTOCOL_FRESH}\r\n{credential}\r\n"
    );
    writer.write_all(upgrade.as_bytes()).await.map_err(failed)?;
    let mut reader = BufReader::with_capacity(64 << 10, reader);
    if !switched(&mut reader).await.map_err(failed)? {
        return Err(LinkError::Unsupported);
    }
    let (frames, queue) = mpsc::unbounded_channel();
    let link = Arc::new(Link { state: Mutex::new(LinkState { frames: Some(frames), ..LinkState::default() }) });
    let (for_writer, for_reader) = (Arc::downgrade(&link), Arc::downgrade(&link));
    let writing = tokio::spawn(async move {
        if let Err(err) = write_frames(writer, queue).await {
            if let Some(link) = for_writer.upgrade() {
                link.close(format!("the read link broke: {err}"));
            }
        }
    });
    let addr = addr.to_string();
    let reading = tokio::spawn(async move {
        let why = read_answers(&mut reader, &for_reader).await;
        tracing::debug!(addr, why, "a read link closed");
        if let Some(link) = for_reader.upgrade() {
            link.close(why);
        }
    });
    lock(&link.state, LINK_STATE).tasks = vec![reading.abort_handle(), writing.abort_handle()];
    Ok(link)
}

/// Reads the answer to the upgrade: `true` when it switched protocols (its head read
/// up to the blank line), `false` for any other status.
async fn switched<R: AsyncRead + Unpin>(reader: &mut BufReader<R>) -> std::io::Result<bool> {
    let invalid = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    let (mut line, mut left, mut first) = (Vec::new(), MAX_HEAD_BYTES, true);
    loop {
        line.clear();
        let read = (&mut *reader).take(left).read_until(b'\n', &mut line).await?;
        if !line.ends_with(b"\n") {
            return Err(match read as u64 == left {
                true => invalid("an upgrade answer's head over 16 KiB"),
                false => std::io::ErrorKind::UnexpectedEof.into(),
            });
        }
        left -= read as u64;
        if first {
            first = false;
            let mut words = line.split(u8::is_ascii_whitespace).filter(|word| !word.is_empty());
            let (version, status) = (words.next(), words.next());
            if !version.is_some_and(|v| v.starts_with(b"HTTP/")) || status.is_none() {
                return Err(invalid("not an HTTP answer"));
            }
            if status == Some(b"401".as_slice()) {
                return Err(invalid("the counter refused the cluster token (401)"));
            }
            if status != Some(b"101".as_slice()) {
                return Ok(false);
            }
        } else if line == b"\r\n" || line == b"\n" {
            return Ok(true);
        }
    }
}

/// Hands every answer to the read waiting for it, until the link breaks or nothing
/// holds it any more: why it ended.
async fn read_answers<R: AsyncRead + Unpin>(reader: &mut R, link: &Weak<Link>) -> String {
    let mut message = Vec::new();
    loop {
        let id = match read_frame(reader, &mut message, MAX_FRAME_BYTES).await {
            Ok(Some(id)) => id,
            Ok(None) => return "the counter closed the read link".into(),
            Err(err) => return format!("the read link broke: {err}"),
        };
        let answer = match FreshReadResponse::decode(&message) {
            Ok(answer) => answer,
            // Nothing on this link can be trusted after a frame that does not decode.
            Err(err) => return format!("a read-link answer did not decode: {err}"),
        };
        let Some(link) = link.upgrade() else { return "no longer used".into() };
        let waiting = {
            let mut state = lock(&link.state, LINK_STATE);
            state.answers += 1;
            // An answer nobody waits for any more (its read timed out) is dropped.
            state.waiting.remove(&id)
        };
        if let Some(waiting) = waiting {
            if waiting.send(Ok(answer)).is_err() {
                tracing::debug!(id, "a read gave up before its answer came");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tally_core::wire::ShardOutcome;
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;

    use super::*;

    #[derive(Clone)]
    enum Peer {
        /// Answers the first two requests of a link in reverse order, later ones at once.
        Reversing,
        /// Closes its first link after reading a request; answers on later ones.
        ClosingFirst,
        /// Never answers.
        Silent,
        /// Never answers the upgrade.
        Mute,
        /// Answers the first read of each link and closes the link at the next,
        /// which it leaves unanswered.
        OncePerLink,
        /// Answers the upgrade with these bytes, then waits.
        Greeting(Vec<u8>),
        /// Upgrades, then answers the first read with these bytes.
        Answering(Vec<u8>),
        /// Answers the upgrade with 404, as a counter without links does.
        NoLinks,
    }

    /// An answer that says which request it is for: its clock.
    fn answer_to(request: &ReadRequest) -> FreshReadResponse {
        FreshReadResponse {
            shards: vec![ShardOutcome::Unavailable { message: format!("answer to {}", request.now_ms) }],
            as_of: vec![None],
        }
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
                tokio::spawn(serve(peer.clone(), index, stream));
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
        match &peer {
            // No reason phrase, no headers: all a refusal needs.
            Peer::NoLinks => return writer.write_all(b"HTTP/1.1 404\r\n").await.unwrap(),
            Peer::Mute => return std::future::pending().await,
            Peer::Greeting(bytes) => {
                writer.write_all(bytes).await.unwrap();
                return std::future::pending().await;
            }
            _ => {}
        }
        let switching =
            format!("HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: {PROTOCOL_FRESH}\r\n\r\n");
        writer.write_all(switching.as_bytes()).await.unwrap();
        let mut message = Vec::new();
        let (mut held, mut answered) = (Vec::new(), 0);
        while let Ok(Some(id)) = read_frame(&mut reader, &mut message, MAX_FRAME_BYTES).await {
            let request = ReadRequest::decode(&message).unwrap();
            match &peer {
                Peer::Silent => continue,
                Peer::Answering(bytes) => {
                    writer.write_all(bytes).await.unwrap();
                    continue;
                }
                Peer::OncePerLink if answered > 0 => return,
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
            answered += 1;
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
    async fn a_read_without_an_answer_times_out_and_closes_the_silent_link() {
        let (addr, connections) = peer(Peer::Silent).await;
        let links = Links::new(Duration::from_millis(300));
        let started = Instant::now();
        assert_eq!(links.read(&addr, &request(5)).await, Err(LinkError::Failed("no answer within 300ms".into())));
        assert!(started.elapsed() >= Duration::from_millis(300));
        {
            let slot = lock(&links.slots, SLOTS)[&addr].clone();
            let Slot::Open(link) = &*slot.try_lock().unwrap() else { panic!("no link") };
            let state = lock(&link.state, LINK_STATE);
            assert_eq!(state.closed.as_deref(), Some("no answer within 300ms, nor to any later read"));
            assert!(state.waiting.is_empty() && state.frames.is_none() && state.tasks.is_empty());
        }
        assert_eq!(links.read(&addr, &request(6)).await, Err(LinkError::Failed("no answer within 300ms".into())));
        assert_eq!(connections.load(Ordering::SeqCst), 2, "the next read opened a new link");
    }

    #[tokio::test]
    async fn reads_queued_behind_an_opening_that_fails_fail_with_it() {
        let (addr, connections) = peer(Peer::Mute).await;
        let links = Links::new(Duration::from_millis(500));
        let started = Instant::now();
        let requests: Vec<ReadRequest> = (0..5).map(request).collect();
        let reads = futures::future::join_all(requests.iter().map(|r| links.read(&addr, r))).await;
        let why = format!("no read link to {addr} within 500ms");
        assert_eq!(reads, (0..5).map(|_| Err(LinkError::Failed(why.clone()))).collect::<Vec<_>>());
        // One opening's time, not one per read (2.5 s).
        assert!(started.elapsed() < Duration::from_millis(1_500), "took {:?}", started.elapsed());
        assert_eq!(connections.load(Ordering::SeqCst), 1);
        // A read that comes later tries again (the counter may be back).
        assert_eq!(links.read(&addr, &request(5)).await, Err(LinkError::Failed(why)));
        assert_eq!(connections.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_link_found_open_that_closes_under_a_read_is_replaced_within_it() {
        let (addr, connections) = peer(Peer::OncePerLink).await;
        let links = Links::new(Duration::from_secs(5));
        for now in 0..3 {
            assert_eq!(links.read(&addr, &request(now)).await, Ok(answer_to(&request(now))));
        }
        assert_eq!(connections.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_counter_without_links_is_read_over_http_and_not_asked_again_for_a_while() {
        let (addr, connections) = peer(Peer::NoLinks).await;
        let links = Links::new(Duration::from_secs(5));
        assert_eq!(links.read(&addr, &request(6)).await, Err(LinkError::Unsupported));
        assert_eq!(links.read(&addr, &request(6)).await, Err(LinkError::Unsupported));
        assert_eq!(connections.load(Ordering::SeqCst), 1, "the refusal is remembered");
        let unreachable = Links::new(Duration::from_secs(5));
        // A port held but not listened on: connections to it are refused.
        let held = tokio::net::TcpSocket::new_v4().unwrap();
        held.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let closed_port = held.local_addr().unwrap().to_string();
        let refused = format!("{closed_port}: {}", TcpStream::connect(&closed_port).await.unwrap_err());
        // An unreachable counter is not one without links.
        assert_eq!(unreachable.read(&closed_port, &request(6)).await, Err(LinkError::Failed(refused)));
    }

    #[tokio::test]
    async fn garbage_or_an_oversized_answer_from_a_counter_fails_the_read_and_closes_the_link() {
        let garbage = b"not a read response".to_vec();
        let undecodable = FreshReadResponse::decode(&garbage).unwrap_err();
        let mut oversized = (MAX_FRAME_BYTES as u32 + 1).to_be_bytes().to_vec();
        oversized.extend_from_slice(&[0; 8]);
        let mut endless = b"HTTP/1.1 101 Switching Protocols\r\n".to_vec();
        endless.extend(std::iter::repeat_n(b"x-padding: 0123456789\r\n".as_slice(), 1_000).flatten());
        let cases = [
            (Peer::Greeting(b"SSH-2.0-OpenSSH_9.2\r\n".to_vec()), "{addr}: not an HTTP answer".to_string()),
            (Peer::Greeting(endless), "{addr}: an upgrade answer's head over 16 KiB".to_string()),
            (Peer::Answering(frame(0, &garbage).unwrap()), format!("a read-link answer did not decode: {undecodable}")),
            (
                Peer::Answering(oversized),
                format!("the read link broke: a read-link frame of {} bytes", MAX_FRAME_BYTES + 1),
            ),
        ];
        for (peer, why) in cases {
            let (addr, connections) = self::peer(peer).await;
            let links = Links::new(Duration::from_secs(5));
            let why = why.replace("{addr}", &addr);
            for _ in 0..2 {
                assert_eq!(links.read(&addr, &request(8)).await, Err(LinkError::Failed(why.clone())));
            }
            assert_eq!(connections.load(Ordering::SeqCst), 2, "{why}: each read on a link of its own");
        }
    }
}
