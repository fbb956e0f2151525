//! Store semantics (limits, purge variants, pending counts, wildcard loads), written once
//! against the trait and instantiated for every store.

use crate::*;
use std::time::Duration;

pub(crate) type Mk<'a> = &'a mut dyn FnMut(Limits) -> Box<dyn Store>;

fn put(s: &mut dyn Store, subj: &str, data: &str) -> u64 {
    s.store_msg(subj.as_bytes(), b"", data.as_bytes(), 1_000)
        .unwrap()
}

fn fill(s: &mut dyn Store) {
    // 1:a 2:b 3:a.x 4:b 5:c.y.z 6:a 7:b 8:a.x
    for (i, subj) in ["a", "b", "a.x", "b", "c.y.z", "a", "b", "a.x"]
        .iter()
        .enumerate()
    {
        assert_eq!(put(s, subj, &format!("m{}", i + 1)), i as u64 + 1);
    }
}

pub(crate) fn basic(mk: Mk) {
    let mut s = mk(Limits::default());
    assert_eq!(s.state(), State::default());
    assert_eq!(s.load(1), Err(StoreError::NotFound));
    let seq = s
        .store_msg(b"foo", b"NATS/1.0\r\nA: b\r\n\r\n", b"hello", 42)
        .unwrap();
    assert_eq!(seq, 1);
    s.sync().unwrap();
    let m = s.load(1).unwrap();
    assert_eq!(&m.subject[..], b"foo");
    assert_eq!(&m.hdr[..], b"NATS/1.0\r\nA: b\r\n\r\n");
    assert_eq!(&m.data[..], b"hello");
    assert_eq!(m.ts, 42);
    let st = s.state();
    assert_eq!((st.msgs, st.first_seq, st.last_seq), (1, 1, 1));
    assert_eq!((st.first_ts, st.last_ts, st.num_subjects), (42, 42, 1));
    assert!(st.bytes > 0);
    assert_eq!(s.remove(1, false), Ok(true));
    assert_eq!(s.remove(1, false), Ok(false));
    let st = s.state();
    // Empty after a removal: first = last + 1, first_ts 0.
    assert_eq!((st.msgs, st.bytes, st.first_seq, st.last_seq), (0, 0, 2, 1));
    assert_eq!((st.first_ts, st.last_ts, st.num_deleted), (0, 42, 0));
    assert_eq!(put(&mut *s, "x", "y"), 2);
    assert_eq!(s.state().first_seq, 2);
}

pub(crate) fn deletes(mk: Mk) {
    let mut s = mk(Limits::default());
    fill(&mut *s);
    assert!(s.remove(3, false).unwrap());
    assert!(s.remove(5, true).unwrap());
    assert_eq!(s.state().num_deleted, 2);
    assert_eq!(s.deleted(), vec![3, 5]);
    assert!(s.remove(1, false).unwrap());
    assert!(s.remove(2, false).unwrap());
    // The gap at the front is not a delete any more: first moved past it.
    let st = s.state();
    assert_eq!((st.first_seq, st.num_deleted), (4, 1));
    assert_eq!(s.deleted(), vec![5]);
    assert!(s.remove(8, false).unwrap());
    let st = s.state();
    assert_eq!((st.last_seq, st.msgs, st.num_deleted), (8, 3, 2));
    assert_eq!(s.deleted(), vec![5, 8]);
    assert_eq!(s.load(8), Err(StoreError::NotFound));
    assert_eq!(s.load_last(">").unwrap().seq, 7);
}

pub(crate) fn max_msgs(mk: Mk) {
    let mut s = mk(Limits {
        max_msgs: 3,
        ..Default::default()
    });
    for i in 1..=5 {
        put(&mut *s, "a", &i.to_string());
    }
    let st = s.state();
    assert_eq!((st.msgs, st.first_seq, st.last_seq), (3, 3, 5));

    let mut s = mk(Limits {
        max_msgs: 3,
        discard: Discard::New,
        ..Default::default()
    });
    for i in 1..=3 {
        put(&mut *s, "a", &i.to_string());
    }
    assert_eq!(s.store_msg(b"a", b"", b"4", 0), Err(StoreError::MaxMsgs));
    assert_eq!(s.state().last_seq, 3);
}

pub(crate) fn max_bytes(mk: Mk) {
    let mut probe = mk(Limits::default());
    put(&mut *probe, "a", "0123456789");
    let one = probe.state().bytes;
    let mut s = mk(Limits {
        max_bytes: (one * 3) as i64,
        ..Default::default()
    });
    for _ in 0..5 {
        put(&mut *s, "a", "0123456789");
    }
    assert_eq!(s.state().msgs, 3);
    assert_eq!(s.state().bytes, one * 3);

    let mut s = mk(Limits {
        max_bytes: (one * 3) as i64,
        discard: Discard::New,
        ..Default::default()
    });
    for _ in 0..3 {
        put(&mut *s, "a", "0123456789");
    }
    assert_eq!(
        s.store_msg(b"a", b"", b"0123456789", 0),
        Err(StoreError::MaxBytes)
    );
    assert_eq!(s.state().msgs, 3);
}

pub(crate) fn per_subject(mk: Mk) {
    let mut s = mk(Limits {
        max_msgs_per_subject: 2,
        ..Default::default()
    });
    for subj in ["a", "b", "a", "a", "b", "a"] {
        put(&mut *s, subj, "x");
    }
    // a: 1 3 4 6 -> 4 6; b: 2 5
    assert_eq!(s.subjects(">").get("a"), Some(&2));
    assert_eq!(s.subjects(">").get("b"), Some(&2));
    assert_eq!(s.state().first_seq, 2);
    assert_eq!(s.deleted(), vec![3]);
    assert_eq!(s.last_seq_for_subject("a"), 6);
    assert_eq!(s.last_seq_for_subject("b"), 5);
    assert_eq!(s.last_seq_for_subject("c"), 0);

    // Discard new without the per-subject flag: at the subject limit the new message
    // replaces that subject's oldest, even when the stream is at max_msgs.
    let mut s = mk(Limits {
        max_msgs: 2,
        max_msgs_per_subject: 1,
        discard: Discard::New,
        ..Default::default()
    });
    put(&mut *s, "a", "1");
    put(&mut *s, "b", "1");
    assert_eq!(s.store_msg(b"c", b"", b"1", 0), Err(StoreError::MaxMsgs));
    assert_eq!(s.store_msg(b"a", b"", b"2", 0), Ok(3));
    assert_eq!(s.state().msgs, 2);
    assert_eq!(s.load_last("a").unwrap().seq, 3);

    let mut s = mk(Limits {
        max_msgs_per_subject: 1,
        discard: Discard::New,
        discard_new_per_subject: true,
        ..Default::default()
    });
    put(&mut *s, "a", "1");
    assert_eq!(
        s.store_msg(b"a", b"", b"2", 0),
        Err(StoreError::MaxMsgsPerSubject)
    );
    assert_eq!(s.store_msg(b"b", b"", b"2", 0), Ok(2));

    // Per-subject flag without discard new is ignored (discard old applies).
    let mut s = mk(Limits {
        max_msgs_per_subject: 1,
        discard_new_per_subject: true,
        ..Default::default()
    });
    put(&mut *s, "a", "1");
    assert_eq!(s.store_msg(b"a", b"", b"2", 0), Ok(2));
    assert_eq!(s.state().msgs, 1);
}

pub(crate) fn max_msg_size(mk: Mk) {
    let mut s = mk(Limits {
        max_msg_size: 10,
        ..Default::default()
    });
    assert_eq!(s.store_msg(b"a", b"12345", b"12345", 0), Ok(1));
    assert_eq!(
        s.store_msg(b"a", b"12345", b"123456", 0),
        Err(StoreError::MsgTooLarge)
    );
    assert_eq!(
        s.store_msg(b"a", b"", b"12345678901", 0),
        Err(StoreError::MsgTooLarge)
    );
    assert_eq!(s.state().msgs, 1);
}

fn purge_opts(filter: Option<&str>, seq: Option<u64>, keep: Option<u64>) -> Purge {
    Purge {
        filter: filter.map(String::from),
        seq,
        keep,
    }
}

pub(crate) fn purges(mk: Mk) {
    // Plain purge of everything.
    let mut s = mk(Limits::default());
    fill(&mut *s);
    assert_eq!(s.purge(&Purge::default()), Ok(8));
    let st = s.state();
    assert_eq!((st.msgs, st.bytes, st.first_seq, st.last_seq), (0, 0, 9, 8));
    assert_eq!((st.first_ts, st.num_subjects, st.num_deleted), (0, 0, 0));
    assert_eq!(put(&mut *s, "a", "x"), 9);

    // Purge of a never-used stream (reference: first becomes last + 1 = 1).
    let mut s = mk(Limits::default());
    assert_eq!(s.purge(&Purge::default()), Ok(0));
    assert_eq!(s.state().first_seq, 1);
    assert_eq!(put(&mut *s, "a", "x"), 1);

    // Filter.
    let mut s = mk(Limits::default());
    fill(&mut *s);
    assert_eq!(s.purge(&purge_opts(Some("a.*"), None, None)), Ok(2));
    // Purging the last message keeps last_seq: it becomes a delete.
    assert_eq!(s.deleted(), vec![3, 8]);
    assert_eq!(s.state().last_seq, 8);
    assert_eq!(s.state().msgs, 6);
    assert_eq!(s.purge(&purge_opts(Some("a"), None, None)), Ok(2));
    assert_eq!(s.state().first_seq, 2);

    // Keep newest N overall and of a filter.
    let mut s = mk(Limits::default());
    fill(&mut *s);
    assert_eq!(s.purge(&purge_opts(None, None, Some(3))), Ok(5));
    assert_eq!(s.state().first_seq, 6);
    let mut s = mk(Limits::default());
    fill(&mut *s);
    assert_eq!(s.purge(&purge_opts(Some("b"), None, Some(1))), Ok(2));
    assert_eq!(s.subjects("b").get("b"), Some(&1));
    assert_eq!(s.load_last("b").unwrap().seq, 7);
    assert_eq!(s.purge(&purge_opts(Some("b"), None, Some(5))), Ok(0));

    // Below a sequence: everything, and only a filter.
    let mut s = mk(Limits::default());
    fill(&mut *s);
    assert_eq!(s.purge(&purge_opts(None, Some(1), None)), Ok(0));
    assert_eq!(s.purge(&purge_opts(None, Some(4), None)), Ok(3));
    assert_eq!(s.state().first_seq, 4);
    assert_eq!(s.purge(&purge_opts(None, Some(2), None)), Ok(0));
    assert_eq!(s.purge(&purge_opts(Some("a.x"), Some(8), None)), Ok(0));
    assert_eq!(s.purge(&purge_opts(Some("b"), Some(8), None)), Ok(2));
    assert_eq!(s.deleted(), vec![7]);
    assert_eq!(s.state().first_seq, 5);

    // Below a sequence past the end: the next message gets that sequence.
    let mut s = mk(Limits::default());
    fill(&mut *s);
    assert_eq!(s.purge(&purge_opts(Some(">"), Some(20), None)), Ok(8));
    let st = s.state();
    assert_eq!((st.msgs, st.first_seq, st.last_seq), (0, 20, 19));
    assert_eq!(put(&mut *s, "a", "x"), 20);
    assert_eq!(s.state().first_seq, 20);
}

pub(crate) fn pending(mk: Mk) {
    let mut s = mk(Limits::default());
    fill(&mut *s);
    assert_eq!(s.num_pending(0, "", false), 8);
    assert_eq!(s.num_pending(1, ">", false), 8);
    assert_eq!(s.num_pending(4, ">", false), 5);
    assert_eq!(s.num_pending(9, ">", false), 0);
    assert_eq!(s.num_pending(1, "a", false), 2);
    assert_eq!(s.num_pending(2, "a", false), 1);
    assert_eq!(s.num_pending(7, "a", false), 0);
    assert_eq!(s.num_pending(1, "a.*", false), 2);
    assert_eq!(s.num_pending(4, "a.>", false), 1);
    assert_eq!(s.num_pending(1, "*", false), 5);
    assert_eq!(s.num_pending(3, "*", false), 3);
    assert_eq!(s.num_pending(1, "nope", false), 0);
    assert_eq!(s.num_pending(1, ">", true), 4);
    assert_eq!(s.num_pending(7, ">", true), 2);
    assert_eq!(s.num_pending(1, "*", true), 2);
    s.remove(4, false).unwrap();
    s.remove(6, false).unwrap();
    assert_eq!(s.num_pending(3, ">", false), 4);
    assert_eq!(s.num_pending(2, "*", false), 2);
    assert_eq!(s.num_pending(6, "a", true), 0);
}

pub(crate) fn loads(mk: Mk) {
    let mut s = mk(Limits::default());
    fill(&mut *s);
    assert_eq!(s.load_next(0, ">").unwrap().seq, 1);
    assert_eq!(s.load_next(2, "a").unwrap().seq, 6);
    assert_eq!(s.load_next(2, "a.*").unwrap().seq, 3);
    assert_eq!(s.load_next(4, "a.*").unwrap().seq, 8);
    assert_eq!(s.load_next(1, "*.*.*").unwrap().seq, 5);
    assert_eq!(s.load_next(6, "*.*.*"), Err(StoreError::NotFound));
    assert_eq!(s.load_next(9, ">"), Err(StoreError::NotFound));
    assert_eq!(s.load_next(1, "zz"), Err(StoreError::NotFound));
    assert_eq!(s.load_last(">").unwrap().seq, 8);
    assert_eq!(s.load_last("b").unwrap().seq, 7);
    assert_eq!(s.load_last("*").unwrap().seq, 7);
    assert_eq!(s.load_last("c.>").unwrap().seq, 5);
    assert_eq!(s.load_last("d"), Err(StoreError::NotFound));
    let m = s.load_last("a.x").unwrap();
    assert_eq!((&m.subject[..], &m.data[..]), (&b"a.x"[..], &b"m8"[..]));
    s.remove(8, false).unwrap();
    assert_eq!(s.load_last("a.x").unwrap().seq, 3);
    assert_eq!(s.last_seq_for_subject("a.x"), 3);
    assert_eq!(s.load_last(">").unwrap().seq, 7);
}

pub(crate) fn subjects(mk: Mk) {
    let mut s = mk(Limits::default());
    fill(&mut *s);
    let all = s.subjects(">");
    assert_eq!(all.len(), 4);
    assert_eq!(all["b"], 3);
    let a = s.subjects("a.*");
    assert_eq!(a.len(), 1);
    assert_eq!(a["a.x"], 2);
    assert_eq!(s.subjects("c.y.z")["c.y.z"], 1);
    assert!(s.subjects("q").is_empty());
    assert_eq!(s.state().num_subjects, 4);
    s.remove(5, false).unwrap();
    assert_eq!(s.state().num_subjects, 3);
}

pub(crate) fn expiry(mk: Mk) {
    let sec = 1_000_000_000i64;
    let mut s = mk(Limits {
        max_age: Duration::from_secs(10),
        ..Default::default()
    });
    for t in [1, 2, 3, 20] {
        s.store_msg(b"a", b"", b"x", t * sec).unwrap();
    }
    assert_eq!(s.expire(5 * sec).unwrap(), (0, Some(11 * sec)));
    assert_eq!(s.expire(12 * sec).unwrap(), (2, Some(13 * sec)));
    assert_eq!(s.expire(25 * sec).unwrap(), (1, Some(30 * sec)));
    assert_eq!(s.expire(31 * sec).unwrap(), (1, None));
    let st = s.state();
    assert_eq!((st.msgs, st.first_seq, st.last_seq), (0, 5, 4));
    let mut s = mk(Limits::default());
    s.store_msg(b"a", b"", b"x", 0).unwrap();
    assert_eq!(s.expire(i64::MAX).unwrap(), (0, None));
}

/// `Nats-TTL: never`: an exempt message stays while max_age removes the others around it.
pub(crate) fn expiry_exempt(mk: Mk) {
    let sec = 1_000_000_000i64;
    let mut s = mk(Limits {
        max_age: Duration::from_secs(10),
        ..Default::default()
    });
    for t in [1, 2, 3, 20] {
        s.store_msg(b"a", b"", b"x", t * sec).unwrap();
    }
    s.exempt_from_max_age(2);
    assert_eq!(s.expire(15 * sec).unwrap(), (2, Some(30 * sec)));
    let st = s.state();
    assert_eq!((st.msgs, st.first_seq, st.last_seq), (2, 2, 4));
    assert_eq!(s.expire(31 * sec).unwrap(), (1, None));
    assert_eq!(s.load(2).unwrap().seq, 2);
    // Removing an exempt message forgets the exemption.
    s.remove(2, false).unwrap();
    s.store_msg(b"a", b"", b"x", 40 * sec).unwrap();
    assert_eq!(s.expire(60 * sec).unwrap(), (1, None));
}

/// skip_to: an empty store restarts at the sequence, a non-empty one counts the skipped
/// sequences as deleted; going backwards does nothing.
pub(crate) fn skip_to(mk: Mk) {
    let mut s = mk(Limits::default());
    s.skip_to(100).unwrap();
    let st = s.state();
    assert_eq!((st.msgs, st.first_seq, st.last_seq), (0, 100, 99));
    assert_eq!(s.store_msg(b"a", b"", b"x", 1).unwrap(), 100);
    s.skip_to(105).unwrap();
    let st = s.state();
    assert_eq!(
        (st.msgs, st.first_seq, st.last_seq, st.num_deleted),
        (1, 100, 104, 4)
    );
    assert_eq!(s.store_msg(b"a", b"", b"y", 2).unwrap(), 105);
    s.skip_to(50).unwrap();
    assert_eq!(s.state().last_seq, 105);
    assert_eq!(s.deleted(), vec![101, 102, 103, 104]);
    assert_eq!(s.load_next(101, ">").unwrap().seq, 105);
}

pub(crate) fn limits_update(mk: Mk) {
    let mut s = mk(Limits::default());
    for subj in ["a", "b", "a", "a", "b", "c"] {
        put(&mut *s, subj, "x");
    }
    s.set_limits(Limits {
        max_msgs_per_subject: 1,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(s.state().msgs, 3);
    assert_eq!(s.deleted(), vec![]);
    assert_eq!(s.state().first_seq, 4);
    s.set_limits(Limits {
        max_msgs: 1,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(s.state().msgs, 1);
    assert_eq!(s.load_last(">").unwrap().seq, 6);
    // Discard new never drops what is already stored.
    let mut s = mk(Limits::default());
    for _ in 0..4 {
        put(&mut *s, "a", "x");
    }
    s.set_limits(Limits {
        max_msgs: 1,
        discard: Discard::New,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(s.state().msgs, 4);
}

/// Invokes `$m!(name)` for every semantics test, so each store can instantiate them.
/// A snapshot's deleted ranges over many messages (full and partly emptied memory chunks,
/// sealed file segments): the runs a scan of every message finds.
pub(crate) fn snapshot_ranges(mk: Mk) {
    let mut s = mk(Limits::default());
    for i in 0..3000u64 {
        put(&mut *s, ["a", "b"][(i % 2) as usize], "x");
    }
    // Whole chunks of 256 left full, one emptied, single holes, runs across boundaries.
    let gone: Vec<u64> = (1..=3)
        .chain([255, 256, 257, 600])
        .chain(769..=1024)
        .chain(1500..=1700)
        .chain([2999, 3000])
        .collect();
    for &q in &gone {
        s.remove(q, false).unwrap();
    }
    s.sync().unwrap();
    let mut want: Vec<(u64, u64)> = Vec::new();
    for q in s.deleted() {
        match want.last_mut() {
            Some((_, b)) if *b + 1 == q => *b = q,
            _ => want.push((q, q)),
        }
    }
    assert_eq!(
        want,
        vec![
            (255, 257),
            (600, 600),
            (769, 1024),
            (1500, 1700),
            (2999, 3000)
        ]
    );
    let snap = s.snapshot();
    assert_eq!((snap.first_seq, snap.last_seq), (4, 3000));
    assert_eq!(snap.deleted, want);
}

/// `store_at`: a given sequence past the last one, the gap counted as deleted; never at or
/// below the last; a refused message keeps the skip.
pub(crate) fn store_at(mk: Mk) {
    let mut s = mk(Limits::default());
    s.store_at(3, b"a", b"", b"x", 10).unwrap();
    let st = s.state();
    assert_eq!((st.msgs, st.first_seq, st.last_seq), (1, 3, 3));
    assert_eq!(
        s.store_at(3, b"a", b"", b"x", 11),
        Err(StoreError::Sequence { seq: 3, last: 3 })
    );
    s.store_at(6, b"b", b"", b"y", 12).unwrap();
    assert_eq!(s.deleted(), vec![4, 5]);
    assert_eq!(
        s.snapshot(),
        Snapshot {
            first_seq: 3,
            last_seq: 6,
            last_ts: 12,
            deleted: vec![(4, 5)]
        }
    );
    assert_eq!(put(&mut *s, "c", "z"), 7);
    assert_eq!(s.load(6).unwrap().data, &b"y"[..]);
    s.set_limits(Limits {
        max_msgs: 3,
        discard: Discard::New,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(
        s.store_at(10, b"a", b"", b"x", 13),
        Err(StoreError::MaxMsgs)
    );
    assert_eq!(s.state().last_seq, 9);
    s.sync().unwrap();
}

/// A replica catches up from a snapshot: it drops what the snapshot has not, reports what
/// it lacks, stores that with `store_at`, and ends equal to the leader.
pub(crate) fn restore(mk: Mk) {
    let mut leader = mk(Limits::default());
    fill(&mut *leader);
    leader.remove(3, false).unwrap();
    leader.remove(6, false).unwrap();
    leader
        .purge(&Purge {
            seq: Some(2),
            ..Default::default()
        })
        .unwrap();
    let snap = leader.snapshot();
    assert_eq!(
        (snap.first_seq, snap.last_seq, snap.deleted.clone()),
        (2, 8, vec![(3, 3), (6, 6)])
    );
    let copy = |leader: &dyn Store, f: &mut dyn Store, missing: &[(u64, u64)]| {
        for &(a, b) in missing {
            for q in a..=b {
                let m = leader.load(q).unwrap();
                f.store_at(q, &m.subject, &m.hdr, &m.data, m.ts).unwrap();
            }
        }
        f.skip_to(snap.last_seq + 1).unwrap();
    };
    // Behind: it has 1..=4 (3 not yet deleted).
    let mut f = mk(Limits::default());
    for subj in ["a", "b", "a.x", "b"] {
        put(&mut *f, subj, "m");
    }
    let missing = f.restore(&snap).unwrap();
    assert_eq!(missing, vec![(5, 5), (7, 8)]);
    copy(&*leader, &mut *f, &missing);
    assert_eq!(f.snapshot(), snap);
    assert_eq!(f.state().msgs, leader.state().msgs);
    // Empty: everything the snapshot has.
    let mut f = mk(Limits::default());
    let missing = f.restore(&snap).unwrap();
    assert_eq!(missing, vec![(2, 2), (4, 5), (7, 8)]);
    copy(&*leader, &mut *f, &missing);
    assert_eq!(f.snapshot(), snap);
    for q in [2, 4, 5, 7, 8] {
        assert_eq!(f.load(q).unwrap().data, leader.load(q).unwrap().data);
    }
    // Ahead: the extra tail goes (where the store can truncate).
    let mut f = mk(Limits::default());
    fill(&mut *f);
    put(&mut *f, "a", "extra");
    match f.restore(&snap) {
        Err(StoreError::Unsupported(_)) => {}
        r => {
            assert_eq!(r.unwrap(), vec![]);
            assert_eq!(f.snapshot(), snap);
        }
    }
}

macro_rules! for_each_semantics_test {
    ($m:ident) => {
        $m!(basic);
        $m!(deletes);
        $m!(max_msgs);
        $m!(max_bytes);
        $m!(per_subject);
        $m!(max_msg_size);
        $m!(purges);
        $m!(pending);
        $m!(loads);
        $m!(subjects);
        $m!(expiry);
        $m!(limits_update);
        $m!(expiry_exempt);
        $m!(skip_to);
        $m!(store_at);
        $m!(restore);
        $m!(snapshot_ranges);
    };
}
pub(crate) use for_each_semantics_test;
