//! Tests shared by both stores.

mod applied;
mod crash;
mod faults;
mod file_tests;
pub(crate) mod model;
mod raftlog;
pub(crate) mod semantics;
mod sim;

mod mem_semantics {
    use super::semantics::*;
    use crate::{MemStore, Store};

    macro_rules! mem_test {
        ($name:ident) => {
            #[test]
            fn $name() {
                super::semantics::$name(&mut |l| Box::new(MemStore::new(l)) as Box<dyn Store>);
            }
        };
    }
    for_each_semantics_test!(mem_test);
}

mod mem_model {
    use super::model::*;
    use crate::{mem_msg_size, Limits, MemStore};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: cases(256), ..ProptestConfig::default() })]
        #[test]
        fn mem_store_matches_model(limits in arb_limits(), ops in prop::collection::vec(arb_op(true), 1..80)) {
            let mut s = MemStore::new(limits.clone());
            let mut m = Model::new(limits, mem_msg_size);
            for (i, op) in ops.iter().enumerate() {
                apply(&mut s, &mut m, op, i as u64);
                check_same(&s, &m, true);
            }
        }
    }

    #[test]
    fn mem_store_default_limits_long_run() {
        // Longer runs with no limits reach past several 256-slot chunks.
        let mut s = MemStore::new(Limits::default());
        let mut m = Model::new(Limits::default(), mem_msg_size);
        let mut rng = 0x1234_5678_9abc_def0u64;
        for step in 0..3000u64 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let op = match rng % 10 {
                0..=6 => Op::Store {
                    subj: (rng >> 8) as usize % SUBJECTS.len(),
                    hdr: 0,
                    data: 8,
                    ts: step as i64,
                },
                7 | 8 => Op::Remove {
                    seq: (rng >> 16) % (m.last + 2),
                    erase: false,
                },
                _ => Op::Purge(crate::Purge {
                    filter: Some(FILTERS[(rng >> 20) as usize % FILTERS.len()].into()),
                    seq: None,
                    keep: Some(50),
                }),
            };
            apply(&mut s, &mut m, &op, step);
            if step % 97 == 0 {
                check_same(&s, &m, true);
            }
        }
        check_same(&s, &m, true);
    }
}

/// Truncation (the memory store; the file store refuses it for now).
#[test]
fn mem_truncate() {
    use crate::{Limits, MemStore, Snapshot, Store};
    let mut s = MemStore::new(Limits::default());
    for i in 0..6u8 {
        s.store_msg(b"a", b"", &[i], i as i64 * 10).unwrap();
    }
    s.remove(4, false).unwrap();
    assert_eq!(s.truncate(4).unwrap(), 2);
    assert_eq!(
        s.snapshot(),
        Snapshot {
            first_seq: 1,
            last_seq: 4,
            last_ts: 20,
            deleted: vec![(4, 4)]
        }
    );
    assert_eq!(s.store_msg(b"a", b"", b"n", 99).unwrap(), 5);
    assert_eq!(s.truncate(9).unwrap(), 0);
    assert_eq!(s.truncate(0).unwrap(), 4);
    let st = s.state();
    assert_eq!(
        (st.msgs, st.first_seq, st.last_seq, st.last_ts),
        (0, 1, 0, 0)
    );
    let mut f = crate::FileStore::open(
        &std::env::temp_dir().join(format!("keel-trunc-{}", std::process::id())),
        Limits::default(),
    )
    .unwrap()
    .0;
    f.store_msg(b"a", b"", b"x", 1).unwrap();
    assert!(matches!(
        f.truncate(0),
        Err(crate::StoreError::Unsupported(_))
    ));
    assert_eq!(f.truncate(1), Ok(0));
    Box::new(f).destroy().unwrap();
}
