//! The read link: how tally-query asks a counter for counts. One long-lived TCP
//! connection per counter, opened as an HTTP/1.1 upgrade on the counter's read port
//! (`GET` [`PATH`], `Upgrade:` [`PROTOCOL`]; 101 Switching Protocols), then binary
//! frames both ways: requests ([`tally_core::wire::ReadRequest`]) and answers —
//! [`tally_core::wire::FreshReadResponse`] on a link opened as [`PROTOCOL_FRESH`],
//! [`tally_core::wire::ReadResponse`] on one opened as [`PROTOCOL`] — in their versioned record format
//! ([`tally_core::format`]), each frame tagged with the request's id so that many
//! reads share the connection at once and answers may come back in any order.
//!
//! A frame is the length of what follows (u32, big-endian), the request id (u64,
//! big-endian) and the message. Whatever has queued by the time a connection's writer
//! runs goes out in one write ([`write_frames`]), so concurrent reads share system
//! calls and wake-ups. A counter that answers the upgrade with anything but 101 (an
//! older release, a proxy that drops upgrades) is read over `POST /internal/v2/read`,
//! which carries the same messages as JSON.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

/// The request that opens a link.
pub const PATH: &str = "/internal/v1/read-link";
/// The protocol named in the upgrade: the framing's version (the messages carry
/// their own).
pub const PROTOCOL: &str = "tally-read-link.v1";
/// The protocol of a link whose answers say how fresh each shard was: what
/// tally-query asks for (a counter that does not know it is read over JSON).
pub const PROTOCOL_FRESH: &str = "tally-read-link.v2";
/// Largest request frame a counter accepts (tally-query's requests are bounded by
/// its 1 MiB request bodies); a longer length prefix means the stream is not a read
/// link (or is corrupt), and the connection is closed.
pub const MAX_REQUEST_BYTES: usize = 4 << 20;
/// Largest frame either side accepts: an answer of many long series.
pub const MAX_FRAME_BYTES: usize = 64 << 20;
/// A reader's buffer that grew past this for one large frame is let go after it.
const KEPT_BUFFER_BYTES: usize = 1 << 20;
/// Bytes of a frame's header: length and id.
const HEADER_BYTES: usize = 12;
/// A writer stops adding queued frames to one write at this size.
const WRITE_BATCH_BYTES: usize = 1 << 20;

/// One frame holding `message` under request `id`.
pub fn frame(id: u64, message: &[u8]) -> io::Result<Vec<u8>> {
    let length = u32::try_from(message.len() + 8)
        .ok()
        .filter(|length| *length as usize <= MAX_FRAME_BYTES)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "a read-link message over 64 MiB"))?;
    let mut out = Vec::with_capacity(HEADER_BYTES + message.len());
    out.extend_from_slice(&length.to_be_bytes());
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(message);
    Ok(out)
}

/// Reads the next frame's message into `message`: its request id, or `None` when
/// the stream ended cleanly between frames. A stream that ends inside a frame, or a
/// frame over `max_bytes`, is an error.
pub async fn read_frame<R: AsyncRead + Unpin>(
    reader: &mut R,
    message: &mut Vec<u8>,
    max_bytes: usize,
) -> io::Result<Option<u64>> {
    let mut header = [0u8; HEADER_BYTES];
    let first = reader.read(&mut header).await?;
    if first == 0 {
        return Ok(None);
    }
    reader.read_exact(&mut header[first..]).await?;
    let length = u32::from_be_bytes(header[..4].try_into().expect("4 bytes")) as usize;
    if !(8..=max_bytes.min(MAX_FRAME_BYTES)).contains(&length) {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a read-link frame of {length} bytes")));
    }
    let id = u64::from_be_bytes(header[4..].try_into().expect("8 bytes"));
    if message.capacity() > KEPT_BUFFER_BYTES && length - 8 <= KEPT_BUFFER_BYTES {
        *message = Vec::new();
    }
    message.resize(length - 8, 0);
    reader.read_exact(message).await?;
    Ok(Some(id))
}

/// Writes the frames sent to `frames` until every sender is gone, each time putting
/// whatever has queued (up to 1 MiB, or one larger frame) into one write.
///
/// Woken by a frame, the writer first yields once: tokio runs a task woken by the
/// running one right after it, so without yielding each read's frame would go out
/// alone, while the other reads (and answers) already in hand wait to add theirs
/// (BENCHMARKS.md, "Reads").
pub async fn write_frames<W: AsyncWrite + Unpin>(
    mut writer: W,
    mut frames: mpsc::UnboundedReceiver<Vec<u8>>,
) -> io::Result<()> {
    let mut batch = Vec::new();
    while let Some(first) = frames.recv().await {
        tokio::task::yield_now().await;
        let Ok(second) = frames.try_recv() else {
            writer.write_all(&first).await?;
            continue;
        };
        batch.clear();
        batch.extend_from_slice(&first);
        batch.extend_from_slice(&second);
        while batch.len() < WRITE_BATCH_BYTES {
            let Ok(next) = frames.try_recv() else { break };
            batch.extend_from_slice(&next);
        }
        writer.write_all(&batch).await?;
    }
    writer.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip_and_queued_frames_share_a_write() {
        let (client, server) = tokio::io::duplex(1 << 16);
        let (sender, queue) = mpsc::unbounded_channel();
        for (id, message) in [(1u64, b"one".as_slice()), (u64::MAX, b""), (7, &[0xA7; 300])] {
            sender.send(frame(id, message).unwrap()).unwrap();
        }
        drop(sender);
        write_frames(client, queue).await.unwrap();
        let mut reader = server;
        let mut message = Vec::new();
        let mut read = Vec::new();
        while let Some(id) = read_frame(&mut reader, &mut message, MAX_FRAME_BYTES).await.unwrap() {
            read.push((id, message.clone()));
        }
        let want = vec![(1u64, b"one".to_vec()), (u64::MAX, Vec::new()), (7, vec![0xA7; 300])];
        assert_eq!(read, want);
    }

    #[tokio::test]
    async fn a_stream_cut_inside_a_frame_or_a_huge_length_is_an_error() {
        let whole = frame(3, b"message").unwrap();
        for cut in [1, 11, 12, whole.len() - 1] {
            let mut reader = &whole[..cut];
            let error = read_frame(&mut reader, &mut Vec::new(), MAX_FRAME_BYTES).await.unwrap_err();
            assert_eq!(error.kind(), io::ErrorKind::UnexpectedEof, "cut at {cut}");
        }
        for (length, max) in [(0u32, MAX_FRAME_BYTES), (7, MAX_FRAME_BYTES), (MAX_FRAME_BYTES as u32 + 1, usize::MAX)]
            .into_iter()
            .chain([(MAX_REQUEST_BYTES as u32 + 1, MAX_REQUEST_BYTES)])
        {
            let mut bytes = length.to_be_bytes().to_vec();
            bytes.extend_from_slice(&[0; 64]);
            let error = read_frame(&mut bytes.as_slice(), &mut Vec::new(), max).await.unwrap_err();
            assert_eq!(error.kind(), io::ErrorKind::InvalidData, "length {length}");
        }
        assert!(frame(1, &vec![0; MAX_FRAME_BYTES]).is_err(), "a message with its id over the limit");
    }
}
