//! A topic's identity: the id Kafka gives a topic when it is created (KIP-516), which
//! a topic deleted and created again under the same name does not keep. A store
//! records the id of the topic it applied ([`crate::store::Store::topic_id`]), and a
//! store that meets another id stops, naming both ([`changed_topic`]).
//!
//! rust-rdkafka does not wrap librdkafka's DescribeTopics (which reads the id from a
//! metadata answer, version 10 on); this calls it directly. A broker that gives no
//! ids answers the all-zero one: then there is no identity to check, and a recreated
//! topic is still told by its offsets ([`crate::consume::ahead_of_log`]).

use std::ffi::{CStr, CString};
use std::time::Duration;

use rdkafka::bindings as rd;
use rdkafka::client::{Client, ClientContext};

use crate::store::Store;
use crate::{Error, Result};

/// The all-zero id, base64: what a broker without topic ids answers.
const NO_ID: &str = "AAAAAAAAAAAAAAAAAAAAAA";

/// The id of `topic` (base64, as Kafka's tools print it), `None` when the broker
/// gives topics no ids; an error when the topic does not exist or no answer came
/// within `timeout`.
pub fn topic_id<C: ClientContext>(client: &Client<C>, topic: &str, timeout: Duration) -> Result<Option<String>> {
    let name = CString::new(topic).map_err(|_| Error::Topics(format!("{topic:?}: a NUL in the name")))?;
    let failed = |what: String| Error::Topics(format!("describing {topic}: {what}"));
    let rk = client.native_ptr();
    // SAFETY: every handle made here is destroyed before returning, the event only
    // after what was read from it is copied out; `name` outlives the collection.
    unsafe {
        let mut names = [name.as_ptr()];
        let collection = rd::rd_kafka_TopicCollection_of_topic_names(names.as_mut_ptr(), 1);
        let options = rd::rd_kafka_AdminOptions_new(rk, rd::rd_kafka_admin_op_t::RD_KAFKA_ADMIN_OP_DESCRIBETOPICS);
        let mut errstr = [0 as std::ffi::c_char; 256];
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        rd::rd_kafka_AdminOptions_set_request_timeout(options, ms, errstr.as_mut_ptr(), errstr.len());
        let queue = rd::rd_kafka_queue_new(rk);
        rd::rd_kafka_DescribeTopics(rk, collection, options, queue);
        let event = rd::rd_kafka_queue_poll(queue, ms.saturating_add(1_000));
        let answer = if event.is_null() {
            Err(failed(format!("no answer within {timeout:?}")))
        } else if rd::rd_kafka_event_error(event) != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
            Err(failed(text(rd::rd_kafka_event_error_string(event))))
        } else {
            let result = rd::rd_kafka_event_DescribeTopics_result(event);
            let mut count = 0usize;
            let topics = match result.is_null() {
                true => std::ptr::null_mut(),
                false => rd::rd_kafka_DescribeTopics_result_topics(result, &mut count),
            };
            match (count, topics.is_null()) {
                (1, false) => {
                    let description = *topics;
                    let error = rd::rd_kafka_TopicDescription_error(description);
                    if error.is_null() {
                        let id = rd::rd_kafka_TopicDescription_topic_id(description);
                        // No id, or none librdkafka could print: no identity to check.
                        let id = if id.is_null() { String::new() } else { text(rd::rd_kafka_Uuid_base64str(id)) };
                        Ok((!id.is_empty() && id != NO_ID).then_some(id))
                    } else {
                        Err(failed(text(rd::rd_kafka_error_string(error))))
                    }
                }
                (count, _) => Err(failed(format!("{count} descriptions for one topic"))),
            }
        };
        if !event.is_null() {
            rd::rd_kafka_event_destroy(event);
        }
        rd::rd_kafka_queue_destroy(queue);
        rd::rd_kafka_AdminOptions_destroy(options);
        rd::rd_kafka_TopicCollection_destroy(collection);
        answer
    }
}

/// A C string librdkafka owns, copied (empty when null).
///
/// # Safety
/// `text` is null or a NUL-terminated string valid for this call.
unsafe fn text(text: *const std::ffi::c_char) -> String {
    if text.is_null() {
        return String::new();
    }
    // SAFETY: as the caller promised.
    unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
}

/// The id of `topic` now, for the checks of [`check_store`]: `None` when the broker
/// gives none, or did not answer (logged; the offsets are still checked).
pub fn current<C: ClientContext>(client: &Client<C>, topic: &str) -> Option<String> {
    match topic_id(client, topic, LOOKUP_WAIT) {
        Ok(id) => id,
        Err(err) => {
            tracing::warn!(topic, error = %err, "reading the topic's id; its stores' identity is not checked now");
            None
        }
    }
}

/// How long [`current`] waits for the broker.
const LOOKUP_WAIT: Duration = Duration::from_secs(10);

/// Checks that `store` applied the topic whose id is `now` (a store that recorded
/// none records it): `Some(reason)` when it applied another ([`changed_topic`]).
pub fn check_store(store: &Store, topic: &str, now: Option<&str>) -> Result<Option<String>> {
    let recorded = store.topic_id()?;
    if let Some(reason) = changed_topic(topic, recorded.as_deref(), now) {
        return Ok(Some(reason));
    }
    if let (None, Some(now)) = (recorded, now) {
        store.record_topic_id(now)?;
    }
    Ok(None)
}

/// Why a store that applied the topic of id `recorded` must stop now that the
/// topic's id is `now` — or `None` (the same topic, or either unknown).
pub fn changed_topic(topic: &str, recorded: Option<&str>, now: Option<&str>) -> Option<String> {
    match (recorded, now) {
        (Some(recorded), Some(now)) if recorded != now => Some(format!(
            "the topic {topic} has id {now}, but the store applied the topic of id {recorded}: it was deleted and \
             recreated; nothing more is applied (restore a store of this topic, or delete the store to rebuild from \
             the log as it is)"
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::consumer::Consumer;

    use super::*;

    #[test]
    fn only_two_known_ids_that_differ_name_a_recreated_topic() {
        assert_eq!(changed_topic("t", None, Some("b")), None, "a store from before ids");
        assert_eq!(changed_topic("t", Some("a"), None), None, "a broker without ids");
        assert_eq!(changed_topic("t", Some("a"), Some("a")), None);
        let reason = changed_topic("t", Some("a"), Some("b")).unwrap();
        assert!(reason.starts_with("the topic t has id b, but the store applied the topic of id a"), "{reason}");
    }

    #[test]
    fn a_store_records_the_first_id_it_meets_and_refuses_another() {
        let dir = tempfile::tempdir().unwrap();
        let open =
            || Store::open(dir.path(), rocksdb::Options::default(), vec![], crate::store::Durability::Wal).unwrap();
        let store = open();
        assert_eq!(check_store(&store, "t", None).unwrap(), None, "no id known: nothing recorded");
        assert_eq!(store.topic_id().unwrap(), None);
        assert_eq!(check_store(&store, "t", Some("a")).unwrap(), None);
        assert_eq!(check_store(&store, "t", Some("a")).unwrap(), None);
        drop(store);
        let store = open();
        assert_eq!(store.topic_id().unwrap().as_deref(), Some("a"), "kept across a restart");
        assert_eq!(check_store(&store, "t", Some("b")).unwrap(), changed_topic("t", Some("a"), Some("b")));
        assert_eq!(check_store(&store, "t", None).unwrap(), None, "the broker gave no id this time");
        assert_eq!(store.topic_id().unwrap().as_deref(), Some("a"), "a refused id is not recorded");
    }

    /// librdkafka's mock cluster has no controller to answer a description: an
    /// error naming the topic, never an id (ids from a real broker: the e2e test
    /// of a recreated shard topic).
    #[test]
    fn an_unanswered_description_is_an_error_not_an_id() {
        let cluster = rdkafka::mocking::MockCluster::new(1).unwrap();
        cluster.create_topic("here", 1, 1).unwrap();
        let kafka = crate::config::KafkaConfig { bootstrap_servers: cluster.bootstrap_servers(), ..Default::default() };
        let consumer: rdkafka::consumer::BaseConsumer = crate::kafka::client_config(&kafka).unwrap().create().unwrap();
        let err = topic_id(consumer.client(), "here", Duration::from_millis(500)).unwrap_err().to_string();
        assert!(err.contains("describing here: "), "{err}");
        assert_eq!(current(consumer.client(), "here"), None);
    }
}
