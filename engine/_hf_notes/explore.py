import time, warnings, torch, transformers
from transformers import AutoModelForCausalLM, DynamicCache
from transformers import (LlamaConfig, Qwen3NextConfig, BambaConfig, GraniteMoeHybridConfig,
                          FalconH1Config, Zamba2Config, Lfm2Config)
torch.set_num_threads(1)
V=256
CFGS = {
 "llama": lambda: LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=V),
 "qwen3_next": lambda: Qwen3NextConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
      intermediate_size=128, vocab_size=V, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
      linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
      num_experts=4, num_experts_per_tok=2),
 "bamba": lambda: BambaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
      vocab_size=V, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, mamba_n_groups=1),
 "granitemoehybrid": lambda: GraniteMoeHybridConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      intermediate_size=128, vocab_size=V, layer_types=["mamba","attention"], mamba_n_heads=4, mamba_d_state=16, mamba_d_conv=4,
      mamba_expand=2, mamba_chunk_size=16, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64),
 "falcon_h1": lambda: FalconH1Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
      vocab_size=V, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, head_dim=16),
 "zamba2": lambda: Zamba2Config(hidden_size=64, num_hidden_layers=3, layers_block_type=["mamba","hybrid","mamba"], num_attention_heads=4,
      num_key_value_heads=4, intermediate_size=128, vocab_size=V, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, n_mamba_heads=4,
      chunk_size=16, adapter_rank=8, use_mem_rope=True),
 "lfm2": lambda: Lfm2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
      vocab_size=V, layer_types=["conv","full_attention"], conv_L_cache=3, block_auto_adjust_ff_dim=False),
}
import sys
names = sys.argv[1:] or list(CFGS)
for name in names:
    print("=====", name)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.manual_seed(0)
            cfg = CFGS[name]()
            print("layer_types:", getattr(cfg, "layer_types", None))
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
            ids = torch.randint(0, V, (1, 64))
            with torch.no_grad():
                t=time.time(); out = model(ids, use_cache=True); dt=time.time()-t
            for x in w: print("WARN:", x.category.__name__, str(x.message)[:200])
        print(type(model).__name__, "attn_impl", model.config._attn_implementation, "fwd %.3fs" % dt)
        c = out.past_key_values
        print("cache", type(c).__name__, "nlayers", len(c.layers), "seq_len", c.get_seq_length())
        for i,l in enumerate(c.layers):
            d = {k:v for k,v in vars(l).items()}
            desc=[]
            for k,v in d.items():
                if isinstance(v, torch.Tensor): desc.append(f"{k}:T{tuple(v.shape)}{str(v.dtype)[6:]}{'' if v.is_contiguous() else ' NC'}")
                elif isinstance(v, dict): desc.append(f"{k}:{ {kk:(tuple(vv.shape) if isinstance(vv,torch.Tensor) else vv) for kk,vv in v.items()} }")
                else: desc.append(f"{k}={v!r}")
            print(f"  [{i}] {type(l).__name__}: " + ", ".join(desc))
    except Exception as e:
        import traceback; traceback.print_exc()
