"""Hugging Face models for the zoo: one tiny model per architecture, called as a training step calls it.

    python -m ckpt_tools.zoo            # every entry, these included

Each entry builds the head model its users train (``LlamaForCausalLM``,
``SwinForImageClassification``, ``WhisperForConditionalGeneration``...) from a
config whose sizes alone are shrunk: two or three repeated blocks per stack,
widths of 16 to 64, a vocabulary under 128, 32x32 or 64x64 images, a fraction of
a second of audio. Everything else stays as the config class gives it (decoders'
``use_cache=True``, dropout, drop path, LayerDrop, SpecAugment), because that
is what a checkpointing plan meets in a user's run. Nothing is downloaded. Two
runs of a step match bit for bit when both start from the same
``torch.manual_seed``, except Wav2Vec2 and HuBERT, whose SpecAugment draws from
numpy's global generator: seed ``numpy.random`` as well for those.

A batch is what a user's collator hands the model: token rows with row 1 padded
as a tokenizer pads it (``attention_mask`` 0, label -100), images, log-mel
features or raw waveforms, and labels, so that ``.loss`` is the head's own loss.

``units`` are the classes Hugging Face's own checkpointing
(``activation_checkpointing_enable()``) runs under ``torch.utils.checkpoint``,
found by running it, in model order; where a checkpointed class runs inside
another one (Swin: ``SwinLayer`` inside ``SwinStage``), the inner one. Models
without their own checkpointing (ALBERT, ConvNeXt, ResNet) have ``own=None``
and, as units, their repeated layer.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from ckpt_tools.zoo import ZooModel, hf_loss

B, T, S, V = 2, 16, 8, 96  # batch, source tokens, target tokens, vocabulary
PAD_FROM = 12  # row 1 is padding from here on, as a tokenizer pads the shorter text of a batch
PIXELS = 32  # image side; SegFormer takes 64 (its first stage strides 4)
SAMPLES = 400  # raw audio for Wav2Vec2 / HuBERT: 39 frames after the shrunk feature encoder
CHARS = 32  # Wav2Vec2 / HuBERT CTC vocabulary
FRAMES, MELS = 32, 16  # Whisper's log-mel input: 2 * max_source_positions frames


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _padded(length: int, pad_from: int, pad_id: int, seed: int, low: int = 3, high: int = V,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)``, both ``(B, length)``: ids above the special ones; row 1 is ``pad_id`` from ``pad_from`` on."""
    ids = torch.randint(low, high, (B, length), generator=_gen(seed))
    mask = torch.ones(B, length, dtype=torch.long)
    mask[1, pad_from:] = 0
    return ids.masked_fill(mask == 0, pad_id), mask


def causal_batch(pad_id: int = 0, mask: bool = True) -> dict[str, Any]:
    """A language-model batch: the labels are the ids, -100 where padded (the model shifts them)."""
    ids, attention = _padded(T, PAD_FROM, pad_id, seed=1)
    labels = ids.masked_fill(attention == 0, -100)
    return dict(input_ids=ids, attention_mask=attention, labels=labels) if mask else dict(input_ids=ids, labels=labels)


def encoder_batch(pad_id: int = 0, labels: str = "tokens") -> dict[str, Any]:
    """An encoder batch: ``labels`` per token (masked LM, -100 where padded) or one class per row."""
    ids, attention = _padded(T, PAD_FROM, pad_id, seed=1)
    target = ids.masked_fill(attention == 0, -100) if labels == "tokens" else torch.tensor([0, 1])
    return dict(input_ids=ids, attention_mask=attention, labels=target)


def seq2seq_batch(pad_id: int = 0) -> dict[str, Any]:
    """A translation / summarisation batch: padded source, target labels (-100 where padded); the model shifts them."""
    ids, attention = _padded(T, PAD_FROM, pad_id, seed=1)
    target, target_mask = _padded(S, S - 2, pad_id, seed=2)
    return dict(input_ids=ids, attention_mask=attention, labels=target.masked_fill(target_mask == 0, -100))


def image_batch(size: int = PIXELS, segments: int = 0) -> dict[str, Any]:
    """``pixel_values`` ``(B, 3, size, size)``; labels: a class per image, or a ``(B, size, size)`` segment map."""
    pixels = torch.randn(B, 3, size, size, generator=_gen(3))
    labels = torch.randint(0, segments, (B, size, size), generator=_gen(4)) if segments else torch.tensor([0, 1])
    return dict(pixel_values=pixels, labels=labels)


def clip_batch() -> dict[str, Any]:
    """CLIP's contrastive step: captions (padded) and their images, ``return_loss=True``."""
    ids, attention = _padded(T, PAD_FROM, 1, seed=1)
    ids[0, -1], ids[1, PAD_FROM - 1] = 2, 2  # each caption ends in the tokenizer's eos (id 2), where CLIP pools
    return dict(input_ids=ids, attention_mask=attention, pixel_values=image_batch()["pixel_values"], return_loss=True)


def whisper_batch() -> dict[str, Any]:
    """Log-mel features ``(B, MELS, FRAMES)`` and the transcript's tokens (-100 where padded)."""
    target, target_mask = _padded(S, S - 2, 0, seed=2)
    features = torch.randn(B, MELS, FRAMES, generator=_gen(5))
    return dict(input_features=features, labels=target.masked_fill(target_mask == 0, -100))


def ctc_batch() -> dict[str, Any]:
    """Raw waveforms ``(B, SAMPLES)`` and CTC character labels (-100 where padded; 0 is CTC's blank)."""
    target, target_mask = _padded(S, S - 2, 0, seed=2, low=1, high=CHARS)
    waves = torch.randn(B, SAMPLES, generator=_gen(5))
    return dict(input_values=waves, labels=target.masked_fill(target_mask == 0, -100))


def activation_checkpointing(model: nn.Module) -> None:
    """Hugging Face's own checkpointing (``gradient_checkpointing_enable`` is its deprecated alias since 5.23)."""
    model.activation_checkpointing_enable()


def _entry(name: str, family: str, units: tuple[str, ...], batch: Callable[[], dict[str, Any]],
           make: Callable[[], nn.Module], own: bool = True) -> ZooModel:
    """One entry; ``own``: Hugging Face checkpoints the model itself (else ``own=None``)."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return make().train()

    return ZooModel(name=f"hf.{name}", family=family, build=build, batch=batch, loss=hf_loss,
                    own=activation_checkpointing if own else None, units=units)


def _decoders(hf: Any) -> list[ZooModel]:
    sizes = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=64)
    gqa = dict(sizes, num_key_value_heads=2)  # grouped-query attention, as Llama-style checkpoints have it
    return [
        _entry("gpt2", "decoder", ("GPT2Block",), causal_batch, lambda: hf.GPT2LMHeadModel(
            hf.GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                          bos_token_id=V - 1, eos_token_id=V - 1))),  # GPT-2's <|endoftext|> is its last id
        _entry("llama", "decoder", ("LlamaDecoderLayer",), causal_batch, lambda: hf.LlamaForCausalLM(
            hf.LlamaConfig(**gqa))),
        _entry("qwen2", "decoder", ("Qwen2DecoderLayer",), causal_batch, lambda: hf.Qwen2ForCausalLM(
            hf.Qwen2Config(**gqa))),
        _entry("mistral", "decoder", ("MistralDecoderLayer",), causal_batch, lambda: hf.MistralForCausalLM(
            hf.MistralConfig(**gqa))),
        _entry("gemma", "decoder", ("GemmaDecoderLayer",), causal_batch, lambda: hf.GemmaForCausalLM(
            hf.GemmaConfig(**gqa, head_dim=8))),
        _entry("gemma2", "decoder", ("Gemma2DecoderLayer",), causal_batch, lambda: hf.Gemma2ForCausalLM(
            hf.Gemma2Config(**gqa, head_dim=8, query_pre_attn_scalar=8, sliding_window=8))),
        _entry("phi", "decoder", ("PhiDecoderLayer",), causal_batch, lambda: hf.PhiForCausalLM(
            hf.PhiConfig(**sizes))),
        _entry("phi3", "decoder", ("Phi3DecoderLayer",), causal_batch, lambda: hf.Phi3ForCausalLM(
            hf.Phi3Config(**gqa, pad_token_id=0, bos_token_id=1, eos_token_id=2))),
        _entry("gpt_neox", "decoder", ("GPTNeoXLayer",), causal_batch, lambda: hf.GPTNeoXForCausalLM(
            hf.GPTNeoXConfig(**sizes))),
        _entry("opt", "decoder", ("OPTDecoderLayer",), partial(causal_batch, pad_id=1), lambda: hf.OPTForCausalLM(
            hf.OPTConfig(vocab_size=V, hidden_size=32, word_embed_proj_dim=32, ffn_dim=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64))),
        _entry("falcon", "decoder", ("FalconDecoderLayer",), causal_batch, lambda: hf.FalconForCausalLM(
            hf.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4))),
        _entry("bloom", "decoder", ("BloomBlock",), partial(causal_batch, pad_id=3), lambda: hf.BloomForCausalLM(
            hf.BloomConfig(vocab_size=V, hidden_size=32, n_layer=2, n_head=4))),
    ]


def _encoders(hf: Any) -> list[ZooModel]:
    sizes = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=64)
    classify = partial(encoder_batch, labels="class")
    return [
        _entry("bert", "encoder", ("BertLayer",), encoder_batch, lambda: hf.BertForMaskedLM(hf.BertConfig(**sizes))),
        _entry("roberta", "encoder", ("RobertaLayer",), partial(classify, pad_id=1),
               lambda: hf.RobertaForSequenceClassification(hf.RobertaConfig(**sizes))),
        # DistilBERT's layer class is called TransformerBlock, like many a user's own
        _entry("distilbert", "encoder", ("TransformerBlock",), classify,
               lambda: hf.DistilBertForSequenceClassification(hf.DistilBertConfig(
                   vocab_size=V, dim=32, hidden_dim=64, n_layers=2, n_heads=4, max_position_embeddings=64))),
        _entry("electra", "encoder", ("ElectraLayer",), encoder_batch, lambda: hf.ElectraForMaskedLM(
            hf.ElectraConfig(**sizes, embedding_size=16))),
        # DeBERTa-v3's attention as its checkpoints configure it: relative, disentangled, no absolute positions
        _entry("deberta_v2", "encoder", ("DebertaV2Layer",), classify,
               lambda: hf.DebertaV2ForSequenceClassification(hf.DebertaV2Config(
                   **sizes, relative_attention=True, pos_att_type=["p2c", "c2p"], position_biased_input=False,
                   max_relative_positions=-1, position_buckets=8))),
        # one layer's weights shared across depth: the same module runs num_hidden_layers times; no own checkpointing
        _entry("albert", "encoder", ("AlbertLayer",), encoder_batch, lambda: hf.AlbertForMaskedLM(
            hf.AlbertConfig(**sizes, embedding_size=16)), own=False),
        # a convolution's output (ConvBERT) and the bmm attention scores (Funnel) written in place inside the
        # layer: what selective saves of them is copied before the write; Funnel has no checkpointing of its own
        _entry("convbert", "encoder", ("ConvBertLayer",), encoder_batch, lambda: hf.ConvBertForMaskedLM(
            hf.ConvBertConfig(**sizes, embedding_size=32))),
        _entry("funnel", "encoder", ("FunnelLayer",), classify, lambda: hf.FunnelForSequenceClassification(
            hf.FunnelConfig(vocab_size=V, block_sizes=[1, 1], d_model=32, n_head=4, d_head=8, d_inner=64,
                            num_labels=2)), own=False),
    ]


def _seq2seq(hf: Any) -> list[ZooModel]:
    sizes = dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
    return [
        _entry("t5", "encoder-decoder", ("T5Block",), seq2seq_batch, lambda: hf.T5ForConditionalGeneration(
            hf.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                        decoder_start_token_id=0))),  # T5's checkpoints start decoding with the pad id, 0
        _entry("bart", "encoder-decoder", ("BartEncoderLayer", "BartDecoderLayer"), partial(seq2seq_batch, pad_id=1),
               lambda: hf.BartForConditionalGeneration(hf.BartConfig(**sizes))),
        _entry("pegasus", "encoder-decoder", ("PegasusEncoderLayer", "PegasusDecoderLayer"), seq2seq_batch,
               lambda: hf.PegasusForConditionalGeneration(hf.PegasusConfig(**sizes))),
        # Marian's pad (= decoder start) is the last id of its vocabulary
        _entry("marian", "encoder-decoder", ("MarianEncoderLayer", "MarianDecoderLayer"),
               partial(seq2seq_batch, pad_id=V - 1), lambda: hf.MarianMTModel(
                   hf.MarianConfig(**sizes, pad_token_id=V - 1, decoder_start_token_id=V - 1))),
        _entry("mbart", "encoder-decoder", ("MBartEncoderLayer", "MBartDecoderLayer"), partial(seq2seq_batch, pad_id=1),
               lambda: hf.MBartForConditionalGeneration(hf.MBartConfig(**sizes))),
    ]


def _moe_and_state_space(hf: Any) -> list[ZooModel]:
    sizes = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    experts = dict(num_experts=4, num_experts_per_tok=2)
    return [
        _entry("mixtral", "moe", ("MixtralDecoderLayer",), causal_batch, lambda: hf.MixtralForCausalLM(
            hf.MixtralConfig(**sizes, num_local_experts=4, num_experts_per_tok=2))),
        _entry("qwen2_moe", "moe", ("Qwen2MoeDecoderLayer",), causal_batch, lambda: hf.Qwen2MoeForCausalLM(
            hf.Qwen2MoeConfig(**sizes, **experts, moe_intermediate_size=32, shared_expert_intermediate_size=64))),
        _entry("olmoe", "moe", ("OlmoeDecoderLayer",), partial(causal_batch, pad_id=1), lambda: hf.OlmoeForCausalLM(
            hf.OlmoeConfig(**sizes, **experts, eos_token_id=2))),  # eos inside the tiny vocabulary
        _entry("mamba", "state-space", ("MambaBlock",), causal_batch, lambda: hf.MambaForCausalLM(
            hf.MambaConfig(vocab_size=V, hidden_size=32, state_size=4, num_hidden_layers=2))),
        _entry("mamba2", "state-space", ("Mamba2Block",), causal_batch, lambda: hf.Mamba2ForCausalLM(
            hf.Mamba2Config(vocab_size=V, hidden_size=32, state_size=4, num_hidden_layers=2, num_heads=8, head_dim=8,
                            n_groups=1, chunk_size=8))),  # heads * head_dim = expand (2) * hidden_size
        # RWKV ignores attention_mask (and says so): its users pass ids and labels
        _entry("rwkv", "state-space", ("RwkvBlock",), partial(causal_batch, mask=False), lambda: hf.RwkvForCausalLM(
            hf.RwkvConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                          intermediate_size=64, context_length=64))),
    ]


def _vision(hf: Any) -> list[ZooModel]:
    vit = dict(image_size=PIXELS, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, num_labels=2)
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    return [
        _entry("vit", "vision", ("ViTLayer",), image_batch, lambda: hf.ViTForImageClassification(hf.ViTConfig(**vit))),
        _entry("deit", "vision", ("DeiTLayer",), image_batch, lambda: hf.DeiTForImageClassification(
            hf.DeiTConfig(**vit))),
        _entry("beit", "vision", ("BeitLayer",), image_batch, lambda: hf.BeitForImageClassification(
            hf.BeitConfig(**vit))),
        # SwinStage and its SwinLayers are both checkpointed, the layers' checkpoints inside the stage's:
        # the layers are the unit (the stage's own checkpoint lowers no peak here: the zoo measures it)
        _entry("swin", "vision", ("SwinLayer",), image_batch, lambda: hf.SwinForImageClassification(
            hf.SwinConfig(image_size=PIXELS, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                          window_size=4, num_labels=2))),
        # _no_split_modules says SegformerStage; what HF checkpoints is each SegformerLayer
        _entry("segformer", "vision", ("SegformerLayer",), partial(image_batch, size=64, segments=4),
               lambda: hf.SegformerForSemanticSegmentation(hf.SegformerConfig(
                   num_encoder_blocks=2, depths=[2, 2], sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3],
                   strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[4, 4], decoder_hidden_size=32,
                   num_labels=4))),
        # Swin V2 checkpoints its stages, not its layers; an addmm output of its attention is written in place
        _entry("swinv2", "vision", ("Swinv2Stage",), image_batch, lambda: hf.Swinv2ForImageClassification(
            hf.Swinv2Config(image_size=PIXELS, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                            window_size=4, num_labels=2))),
        _entry("convnext", "vision", ("ConvNextLayer",), image_batch, lambda: hf.ConvNextForImageClassification(
            hf.ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[2, 2], image_size=PIXELS, num_labels=2)),
            own=False),
        _entry("resnet", "vision", ("ResNetBottleNeckLayer",), image_batch, lambda: hf.ResNetForImageClassification(
            hf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[2, 2], num_labels=2)), own=False),
        # two towers of the same layer class, text and vision
        _entry("clip", "vision", ("CLIPEncoderLayer",), clip_batch, lambda: hf.CLIPModel(hf.CLIPConfig(
            text_config=dict(tower, vocab_size=V, max_position_embeddings=T, bos_token_id=0, eos_token_id=2),
            vision_config=dict(tower, image_size=PIXELS, patch_size=4), projection_dim=16))),
    ]


def _audio(hf: Any) -> list[ZooModel]:
    # a two-layer feature encoder (stride 10) in place of the seven-layer one (stride 320)
    speech = dict(vocab_size=CHARS, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                  num_conv_pos_embedding_groups=4)
    return [
        _entry("whisper", "audio", ("WhisperEncoderLayer", "WhisperDecoderLayer"), whisper_batch,
               lambda: hf.WhisperForConditionalGeneration(hf.WhisperConfig(
                   vocab_size=V, num_mel_bins=MELS, d_model=32, encoder_layers=2, decoder_layers=2,
                   encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                   max_source_positions=FRAMES // 2, max_target_positions=32, pad_token_id=0, bos_token_id=1,
                   eos_token_id=1, decoder_start_token_id=2))),
        # the feature encoder's conv layers are checkpointed too, not only the transformer layers;
        # SpecAugment masks frames with numpy's global generator (transformers' _compute_mask_indices)
        _entry("wav2vec2", "audio", ("Wav2Vec2GroupNormConvLayer", "Wav2Vec2NoLayerNormConvLayer",
                                     "Wav2Vec2EncoderLayer"), ctc_batch,
               lambda: hf.Wav2Vec2ForCTC(hf.Wav2Vec2Config(**speech))),
        _entry("hubert", "audio", ("HubertGroupNormConvLayer", "HubertNoLayerNormConvLayer", "HubertEncoderLayer"),
               ctc_batch, lambda: hf.HubertForCTC(hf.HubertConfig(**speech))),
    ]


def models() -> list[ZooModel]:
    """Every Hugging Face entry; none when ``transformers`` does not import."""
    try:
        import transformers as hf
    except ImportError:
        return []
    return [*_decoders(hf), *_encoders(hf), *_seq2seq(hf), *_moe_and_state_space(hf), *_vision(hf), *_audio(hf)]


__all__ = ["models"]
