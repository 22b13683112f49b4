use std::net::{IpAddr, Ipv4Addr};

use super::*;

#[test]
fn vllm_config_reads_like_vllm() {
    let c = KvEventsConfig::from_vllm_json(
        r#"{"enable_kv_cache_events": true, "publisher": "zmq",
            "endpoint": "tcp://127.0.0.1:5557", "topic": "kv", "replay_endpoint": null}"#,
    )
    .expect("valid")
    .expect("on");
    assert_eq!(
        c.endpoint,
        KvEndpoint::Connect {
            host: "127.0.0.1".into(),
            port: 5557
        }
    );
    assert_eq!((c.topic.as_str(), c.hwm), ("kv", 100_000));
    let bind = KvEventsConfig::from_vllm_json(r#"{"enable_kv_cache_events": true}"#)
        .expect("valid")
        .expect("on");
    assert_eq!(
        bind.endpoint,
        KvEndpoint::Bind {
            host: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            port: 5557
        }
    );
    assert_eq!(bind.topic, "", "vLLM's default topic");
    for off in [
        r#"{}"#,
        r#"{"enable_kv_cache_events": false, "publisher": "zmq"}"#,
        r#"{"enable_kv_cache_events": true, "publisher": "null"}"#,
    ] {
        assert_eq!(
            KvEventsConfig::from_vllm_json(off).expect("valid"),
            None,
            "{off}"
        );
    }
    for bad in [
        "[1]",
        "{",
        r#"{"enable_kv_cache_events": "yes"}"#,
        r#"{"enable_kv_cache_events": true, "publisher": "kafka"}"#,
        r#"{"enable_kv_cache_events": true, "endpoint": "ipc:///tmp/x"}"#,
        r#"{"enable_kv_cache_events": true, "endpoint": "tcp://*:99999"}"#,
        r#"{"enable_kv_cache_events": true, "hwm": -1}"#,
    ] {
        assert!(KvEventsConfig::from_vllm_json(bad).is_err(), "{bad}");
    }
    assert_eq!(
        parse_endpoint("tcp://[::1]:7000").expect("v6"),
        KvEndpoint::Connect {
            host: "::1".into(),
            port: 7000
        }
    );
    assert_eq!(offset(65_535, 1), None);
    assert_eq!(offset(5557, 1), Some(5558));
}

#[test]
fn a_full_journal_drops_its_oldest_and_marks_the_gap() {
    let j = RankEvents::default();
    j.push(vec![KvEvent::removed(vec![1]); MAX_PENDING - 1]);
    j.push(vec![KvEvent::removed(vec![2]), KvEvent::removed(vec![3])]);
    let p = j.take();
    assert_eq!(p.events.len(), MAX_PENDING);
    assert!(p.lost);
    assert_eq!(p.events.last(), Some(&KvEvent::removed(vec![3])));
    j.push(vec![KvEvent::removed(vec![4])]);
    j.restart();
    let p = j.take();
    assert!(p.restarted && !p.lost);
    assert_eq!(
        p.events,
        vec![KvEvent::AllBlocksCleared],
        "unsent events die with the process"
    );
}

#[test]
fn a_subscribers_queue_drops_its_oldest_and_never_waits() {
    let hub = Hub::new(2);
    let quiet = hub.add();
    let peer = hub.add();
    lock(&peer.state).topics.push(b"k".to_vec());
    for i in 0..5u8 {
        hub.publish(b"kv", &Bytes::from(vec![i]));
    }
    let s = lock(&peer.state);
    assert_eq!(s.queue, [Bytes::from(vec![3]), Bytes::from(vec![4])]);
    assert_eq!(
        (
            s.dropped,
            hub.dropped.load(std::sync::atomic::Ordering::Relaxed)
        ),
        (3, 3)
    );
    assert!(
        lock(&quiet.state).queue.is_empty(),
        "no subscription, no messages"
    );
    drop(s);
    assert_eq!(hub.subscribers(), 1);
}
